"""A site's distributed-DP round through its SecureRun (worker/secure_task.py, worker/distributed_step.py), against a
simulated service: the crypto's own SecAggServer, two simulated peers (plain SecAggClients) and a fake aggregation
client that relays the site's calls. The unmasked sum must be the site's quantised gradient sum plus its Skellam share
plus the peers' inputs, exactly; the site declares the μ_i it adds; both figures land on its ledger; a retry sends
the same bytes; a site past its budget sends no key."""

import json

import numpy as np
import pytest

from fedbroker.config import DPPolicy
from fedbroker.errors import BudgetExceeded, TaskRefused
from fedbroker.job.privacy import DistributedDP
from fedbroker.job.spec import parse_model
from fedbroker.model import build_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg import skellam
from fedbroker.secagg.client import SecAggClient
from fedbroker.secagg.errors import SecAggError
from fedbroker.secagg.params import SecAggParams
from fedbroker.secagg.secure_round import round_params, round_seed
from fedbroker.secagg.server import SecAggServer
from fedbroker.worker.budget import SiteBudget, distributed_figures
from fedbroker.worker.distributed_step import DistributedStep, gradient_sum, layout_size, round_for
from fedbroker.worker.ledger import PrivacyLedger
from fedbroker.worker.secure_task import SecureRun

SPEC_RAW = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
                                           {"type": "Linear", "in_features": 3, "out_features": 2}]}
SPEC = parse_model(SPEC_RAW)
SETTINGS = DistributedDP(enabled=True, noise_multiplier=1.0, clip=1.0, sample_rate=0.5, quorum=3)
TASK = pb.RoundTask(job_id="job-d", round=1, model_version=1, participants=3, deadline_unix=4e9)
N = 40


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 4)).astype(np.float32), rng.integers(0, 2, size=N)


class FakeService:
    """The aggregation service's secure calls for one site ("a"), over a SecAggServer whose other two members (b,
    c) the test drives directly."""

    def __init__(self, ddp: skellam.DDPRound) -> None:
        plain = round_params(3)
        self.params = SecAggParams(n_max=3, threshold=plain.threshold, neighbours=plain.neighbours, bits=ddp.bits,
                                   clip=plain.clip)
        self.seed = round_seed(TASK.job_id, TASK.round, TASK.model_version)
        self.server = SecAggServer(self.params, self.seed)
        self.peers = {w: SecAggClient(w, self.params, self.seed, np.random.default_rng(9)) for w in ("b", "c")}
        self.adverts: list[pb.SecAdvertiseRequest] = []
        self.unmasks: list[pb.SecUnmaskRequest] = []
        self.length = ddp.dim

    def sec_advertise(self, request: pb.SecAdvertiseRequest) -> pb.SecAdvertiseReply:
        self.adverts.append(request)
        if len(self.adverts) == 1:
            from fedbroker.secagg.crypto import PublicKeys
            self.server.add_keys("a", PublicKeys(c_pk=request.cipher_key, s_pk=request.mask_key))
            for w, peer in self.peers.items():
                self.server.add_keys(w, peer.advertise())
        p = self.params
        return pb.SecAdvertiseReply(round_seed=self.seed, params=pb.SecParams(
            threshold=p.threshold, neighbours=p.neighbours, ring_bits=p.bits, clip=p.clip, n_max=p.n_max,
            ring_dtype=np.dtype(p.dtype).name, length=self.length))

    def sec_roster(self, job_id, round, worker_id, *, until):
        rosters = self.rosters = self.server.rosters()
        for w, peer in self.peers.items():
            self.server.add_shares(w, peer.share_keys(rosters[w]))
        return pb.SecRosterReply(ready=True, scale=1.0, roster_size=3, peers=[
            pb.SecPeer(worker_id=w, cipher_key=k.c_pk, mask_key=k.s_pk) for w, k in rosters["a"].items()])

    def sec_share(self, request: pb.SecShareRequest) -> None:
        self.server.add_shares("a", {c.peer: c.data for c in request.ciphertexts})

    def sec_inbox(self, job_id, round, worker_id, *, until):
        self.boxes = self.server.inboxes()
        for w, peer in self.peers.items():
            assert peer.open_inbox(self.boxes[w]) == {}
        return pb.SecInboxReply(ready=True, ciphertexts=[pb.SecCiphertext(peer=s, data=d)
                                                         for s, d in self.boxes["a"].items()])

    def sec_verify(self, job_id, round, worker_id, failed, *, until):
        self.server.exclude(set(failed))
        return pb.SecVerifyReply(ready=True, excluded=[])

    def sec_survivors(self, job_id, round, worker_id, *, until):
        self.requests = self.server.unmask_requests()
        r = self.requests["a"]
        return pb.SecSurvivorsReply(ready=True, survivors=sorted(r.survivors), dropped=sorted(r.dropped))

    def sec_unmask(self, request: pb.SecUnmaskRequest) -> None:
        self.unmasks.append(request)
        if len(self.unmasks) == 1:
            self.server.add_unmask("a", {s.peer: s.share for s in request.shares})
            for w, peer in self.peers.items():
                r = self.requests[w]
                self.server.add_unmask(w, peer.unmask(r.survivors, r.dropped))


def ring_sum(service: FakeService) -> np.ndarray:
    """The unmasked integer sum, read back exactly from the float finish (S·Δ − n·B)."""
    result = service.server.finish()
    p = service.params
    levels = np.rint((result.total + 3 * p.clip) / p.step).astype(np.int64)
    return skellam.from_ring(levels, bits=p.bits)


def site(tmp_path, policy: DPPolicy, seed: int = 5) -> tuple[DistributedStep, SiteBudget]:
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"), worker_id="a")
    budget = SiteBudget(worker_id="a", ledger=ledger, dp=policy, num_samples=N)
    return DistributedStep(job_id=TASK.job_id, policy=policy, settings=SETTINGS, budget=budget, num_samples=N,
                           rng=np.random.default_rng(seed)), budget


def test_the_unmasked_sum_is_the_quantised_gradient_sum_plus_the_sites_skellam_share(tmp_path) -> None:
    policy = DPPolicy(epsilon_budget=1e6, mode="distributed")
    step, budget = site(tmp_path, policy)
    model = build_model(SPEC, seed=0)
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    ddp = round_for(participants=3, distributed=SETTINGS, dim=layout_size(SPEC), records=N)
    service = FakeService(ddp)
    run = SecureRun(worker_id="a", task=TASK, num_samples=N, ish=None, ddp=step)
    run.global_model = (1, json.dumps(SPEC_RAW), weights)
    run.exchange_keys(service)
    x, y = data()
    result = step.run(run, model, SPEC, x=x, y=y, task=None, pipeline=None, device="cpu", frozen=())
    peer_ints = {w: np.arange(ddp.dim, dtype=np.int64) * (1 if w == "b" else -3) for w in service.peers}
    for w, peer in service.peers.items():
        service.server.add_masked(w, peer.masked_integers(skellam.to_ring(peer_ints[w], bits=ddp.bits), []))
    service.server.add_masked("a", run.masked)
    run.unmask(service)
    # the site's own integers, drawn again from the same seed in the same order
    rng = np.random.default_rng(5)
    g = gradient_sum(build_model(SPEC, seed=0), x, y, names=list(weights), clip=1.0, sample_rate=0.5, rng=rng)
    ours = skellam.quantise(g.vector, scale=ddp.scale, rng=rng)
    noise = skellam.noise_share(rng, size=ddp.dim, variance=step.mu)
    np.testing.assert_array_equal(ring_sum(service), ours + noise + peer_ints["b"] + peer_ints["c"])
    assert noise.any()
    # μ_i is the distributed share, declared in the advertisement; the masked bytes are no clear sum
    assert step.mu == pytest.approx(ddp.full_variance / 3)
    assert service.adverts[0].noise_variance == pytest.approx(step.mu)
    assert not np.array_equal(run.masked, skellam.to_ring(ours + noise, bits=ddp.bits))
    # both figures on the ledger, as reported
    assert budget.ledger.epsilon(TASK.job_id) == pytest.approx(result.epsilon)
    assert budget.ledger.floors()[TASK.job_id] == pytest.approx(result.epsilon_local_floor)
    assert result.epsilon_local_floor > result.epsilon > 0
    assert result.state == {} and result.train_loss == 0.0   # the sample's loss is not released
    # a retry sends the same masked bytes and spends nothing more
    masked = run.masked.copy()
    assert step.run(run, model, SPEC, x=x, y=y, task=None, pipeline=None, device="cpu", frozen=()) is result
    run.mask_integers(skellam.to_ring(np.zeros(ddp.dim, dtype=np.int64), bits=ddp.bits), bits=ddp.bits)
    np.testing.assert_array_equal(run.masked, masked)
    assert len(budget.ledger.distributed_rounds(TASK.job_id)) == 1


def test_a_site_past_its_budget_refuses_before_any_key_leaves(tmp_path) -> None:
    step, budget = site(tmp_path, DPPolicy(epsilon_budget=0.01, mode="distributed"))
    service = FakeService(round_for(participants=3, distributed=SETTINGS, dim=layout_size(SPEC), records=N))
    run = SecureRun(worker_id="a", task=TASK, num_samples=N, ish=None, ddp=step)
    run.global_model = (1, json.dumps(SPEC_RAW), {})
    with pytest.raises(BudgetExceeded, match="distributed-DP round would bring ε"):
        run.exchange_keys(service)
    assert service.adverts == [] and run.crypto is None
    assert budget.ledger.total_epsilon() == 0.0


def test_a_service_whose_round_is_not_the_one_the_site_priced_is_refused(tmp_path) -> None:
    step, _ = site(tmp_path, DPPolicy(epsilon_budget=1e6, mode="distributed"))
    step.prepare(TASK, SPEC)
    assert step.settle(pb.SecParams(length=layout_size(SPEC)), TASK) == step.round.bits
    with pytest.raises(TaskRefused, match="not the one this site priced"):
        step.settle(pb.SecParams(length=layout_size(SPEC) + 1), TASK)
    if "ddp_scale" in pb.SecParams.DESCRIPTOR.fields_by_name:   # the service states its round (h-ddpservice)
        for wrong in ({"ddp_scale": step.round.scale * 2}, {"ddp_quorum": 2}, {"ddp_bits": step.round.bits + 1}):
            with pytest.raises(TaskRefused, match="not the one this site priced"):
                step.settle(pb.SecParams(length=layout_size(SPEC), **wrong), TASK)
        with pytest.raises(TaskRefused, match="fewer than this site's"):
            step.settle(pb.SecParams(length=layout_size(SPEC), ddp_records=N - 1), TASK)


def test_a_quorum_the_round_cannot_reach_is_refused_not_retried(tmp_path) -> None:
    step, _ = site(tmp_path, DPPolicy(epsilon_budget=1e6, mode="distributed"))
    with pytest.raises(TaskRefused, match="cannot run distributed DP"):
        step.prepare(pb.RoundTask(job_id="job-d", round=1, participants=2), SPEC)


def test_mu_is_the_whole_dose_in_local_mode_and_is_raised_to_keep_a_floor(tmp_path) -> None:
    ddp = round_for(participants=3, distributed=SETTINGS, dim=layout_size(SPEC), records=N)
    local, _ = site(tmp_path / "l", DPPolicy(epsilon_budget=1e6, mode="local"))
    local.prepare(TASK, SPEC)
    shared, _ = site(tmp_path / "d", DPPolicy(epsilon_budget=1e6, mode="distributed"))
    shared.prepare(TASK, SPEC)
    assert local.mu == pytest.approx(ddp.full_variance)
    assert shared.mu == pytest.approx(ddp.full_variance / 3)
    # the share alone, at z/√3, leaves some ε; a floor below it raises μ_i until the share alone keeps it
    alone = distributed_figures([shared.step])[1]
    floored, _ = site(tmp_path / "f", DPPolicy(epsilon_budget=1e6, mode="distributed",
                                               local_floor_epsilon=alone * 0.8))
    floored.prepare(TASK, SPEC)
    assert ddp.full_variance / 3 < floored.mu <= ddp.full_variance
    assert distributed_figures([floored.step])[1] <= alone * 0.8 * (1 + 1e-9)
    # a floor only more noise than the ring was sized for could keep is refused, not silently broken
    strict, _ = site(tmp_path / "s", DPPolicy(epsilon_budget=1e6, mode="distributed", local_floor_epsilon=1e-3))
    with pytest.raises(TaskRefused, match="floor"):
        strict.prepare(TASK, SPEC)


def test_a_site_with_dp_off_cannot_even_build_its_step(tmp_path) -> None:
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    budget = SiteBudget(worker_id="a", ledger=ledger, dp=None, num_samples=N)
    with pytest.raises(TaskRefused, match="distributed DP"):
        DistributedStep(job_id="job-d", policy=None, settings=SETTINGS, budget=budget, num_samples=N)


def test_integer_inputs_unmask_to_their_exact_sum_when_a_site_drops_after_sharing() -> None:
    """The crypto alone (fedbroker/secagg/client.py `masked_integers`): signed integers in a 20-bit ring, one of four
    sites gone after sharing its keys; the server removes its pairwise masks and the survivors' sum is exact."""
    params = SecAggParams(n_max=4, threshold=3, neighbours=3, bits=20, clip=1.0)
    seed = round_seed("job-i", 1, 1)
    server = SecAggServer(params, seed)
    rng = np.random.default_rng(2)
    clients = {w: SecAggClient(w, params, seed, rng) for w in "abcd"}
    ints = {w: rng.integers(-5000, 5000, size=17) for w in clients}
    for w, c in clients.items():
        server.add_keys(w, c.advertise())
    rosters = server.rosters()
    for w, c in clients.items():
        server.add_shares(w, c.share_keys(rosters[w]))
    boxes = server.inboxes()
    for w, c in clients.items():
        assert c.open_inbox(boxes[w]) == {}
    server.exclude(set())
    for w in "abc":   # d drops before masking
        masked = clients[w].masked_integers(skellam.to_ring(ints[w], bits=20), [])
        assert not np.array_equal(masked, skellam.to_ring(ints[w], bits=20))
        server.add_masked(w, masked)
    for w, request in server.unmask_requests().items():
        server.add_unmask(w, clients[w].unmask(request.survivors, request.dropped))
    result = server.finish()
    levels = np.rint((result.total + 3 * params.clip) / params.step).astype(np.int64)
    np.testing.assert_array_equal(skellam.from_ring(levels, bits=20), ints["a"] + ints["b"] + ints["c"])
    with pytest.raises(SecAggError, match="ring"):
        SecAggClient("e", params, seed, rng).masked_integers(np.zeros(3, dtype=np.uint64))
