"""A worker's side of a secure round (aggregation.secure): the SecAgg+ steps around its training.

Before training it advertises two public keys, fetches its peers' keys once the roster is fixed, sends
each peer its sealed Shamir shares, collects the shares peers sealed for it, opens them and checks them
against their dealers' commitments, and tells the service whose failed; the service answers with every
sender excluded from the round (`exchange_keys`). The key phase costs the round no training time, and a
worker that fails here (excluded itself, or a round left below its threshold) has spent no ε. After training
it uploads its weighted update masked into the ring (`upload`): (w_i / Σ_roster w_j)·(x_i − x_global),
flattened in the model's parameter order, so that the sum over the survivors divided by their weight
share is FedAvg's (or DWFed's) mean delta. At the close it sends the shares the service needs to remove
the masks (`unmask`): of the survivors' self-mask seeds and the dropped workers' mask keys, never both
for one peer (the crypto refuses). Nothing here changes what the worker trains or spends.

In a job with distributed DP (privacy.distributed) the input is no weighted update but the site's noised gradient
sum, already in the ring (worker/distributed_step.py): the site settles the round and its noise share μ_i before
its keys leave (and declares μ_i in its advertisement), and masks the integers as they are (`mask_integers`).

Every call goes through the aggregation service's gRPC channel under the worker's own identity; each is
idempotent, and a `SecureRun` is kept between a task's retries so a retry sends the same keys, shares and
masked bytes again (the crypto object runs each step once).

A `SecureSteps` observer, when one is given (a test's: production passes none), sees the clear weighted
vector just before it is masked and each step as it is done; it is injected, never switched on from outside.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from fedbroker.errors import FedbrokerError
from fedbroker.job.spec import ModelSpec, parameter_shapes, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient, Model
from fedbroker.secagg.client import SecAggClient
from fedbroker.secagg.crypto import PublicKeys
from fedbroker.secagg.groups import group_params
from fedbroker.secagg.secure_round import UNMASK_WAIT_S, below_quorum, round_params, round_seed

if TYPE_CHECKING:
    from fedbroker.worker.distributed_step import DistributedStep

log = logging.getLogger(__name__)

Step = Literal["masked", "uploaded"]


class SecureSteps(Protocol):
    """Who watches a secure task's steps from inside the worker (a test's recorder; None in production)."""

    def clear_update(self, *, worker_id: str, task: pb.RoundTask, vector: np.ndarray, scale: float) -> None:
        """The clear weighted update `vector` (scale·(trained − global)), just before it is masked."""

    def step_done(self, *, worker_id: str, task: pb.RoundTask, step: Step) -> None:
        """`masked`: the update is masked, not yet uploaded; `uploaded`: it is in, the unmask shares not sent."""


class SecureStepFailed(FedbrokerError):
    """A step of the secure protocol could not complete before its round's deadline (the roster or the
    inboxes were not fixed in time, or the round never named its survivors): the task fails."""


def weighted_vector(trained: Mapping[str, np.ndarray], global_state: Mapping[str, np.ndarray], spec: ModelSpec,
                    scale: float) -> np.ndarray:
    """scale·(trained − global), flattened in the model's parameter order (the service's layout)."""
    names = list(parameter_shapes(spec))
    out = np.empty(sum(int(np.asarray(global_state[n]).size) for n in names), dtype=np.float64)
    start = 0
    for name in names:
        g = np.asarray(global_state[name], dtype=np.float64).reshape(-1)
        t = np.asarray(trained[name], dtype=np.float64).reshape(-1)
        np.subtract(t, g, out=out[start:start + g.size])
        start += g.size
    out *= scale
    return out


class SecureRun:
    """One secure task on one worker (see the module docstring)."""

    def __init__(self, *, worker_id: str, task: pb.RoundTask, num_samples: int, ish: float | None,
                 steps: SecureSteps | None = None, group_size: int = 0, ddp: DistributedStep | None = None) -> None:
        """`group_size`: the job's aggregation.secure_group_size (0: one secure sum of every participant)."""
        self.worker_id = worker_id
        self.group_size = group_size
        self.ddp = ddp  # distributed DP: the site's step of the round (None: a weighted update)
        self.steps = steps
        self.task = task
        self.num_samples = num_samples
        self.ish = ish
        self.crypto: SecAggClient | None = None
        self.scale = 0.0
        self.length = 0
        self.dtype = ""
        self._keys: PublicKeys | None = None
        self._advert: pb.SecAdvertiseReply | None = None
        self._shares: dict[str, bytes] | None = None
        self._inbox: dict[str, bytes] | None = None
        self._failed: dict[str, str] | None = None      # senders whose shares failed here, and why
        self.excluded: frozenset[str] | None = None     # senders the round excluded: masked with none of them
        self.masked: np.ndarray | None = None
        self.unmasked = False
        self._unmask_shares: dict[str, bytes] | None = None
        self.global_model: Model | None = None  # the model the task trains from: the masked delta is against it

    def advertise(self, client: AggregatorClient) -> None:
        """Draw the round's keys (settings from the task) and advertise them; the service must run the same
        settings. Once: a retry re-sends the same keys."""
        task, me = self.task, self.worker_id
        if self.crypto is None:
            if self.ddp is not None:  # the round, μ_i and the budget before any key leaves
                assert self.global_model is not None
                self.ddp.prepare(task, parse_model(json.loads(self.global_model[1])))
            params = round_params(task.participants)
            seed = round_seed(task.job_id, task.round, task.model_version)
            self.crypto = SecAggClient(me, params, seed, np.random.default_rng(int.from_bytes(os.urandom(8), "little")))
            self._keys = self.crypto.advertise()
        if self._advert is not None:
            return
        advert = client.sec_advertise(self._advertisement())
        p, ours = advert.params, self.crypto.params
        if self.group_size:  # grouped (fedbroker.secagg.groups): the settings of one of the sizes the split makes
            ours = self.crypto.params = group_params(task.participants, self.group_size, p.n_max) or ours
        bits = self.ddp.settle(p, task) if self.ddp is not None else ours.bits
        if (advert.round_seed != self.crypto.round_seed or (p.n_max, p.threshold, p.neighbours, p.ring_bits, p.clip)
                != (ours.n_max, ours.threshold, ours.neighbours, bits, ours.clip)):
            raise SecureStepFailed(f"round {task.round} of {task.job_id}: the service runs other secure settings "
                                   f"({p.n_max} inputs, t {p.threshold}, ring 2^{p.ring_bits}, clip {p.clip}) than "
                                   f"the task implies ({ours.n_max}, t {ours.threshold}, 2^{bits}, {ours.clip})")
        self._advert, self.length, self.dtype = advert, int(p.length), p.ring_dtype

    def exchange_keys(self, client: AggregatorClient) -> None:
        """Advertise, wait for the roster, send the sealed shares, wait for the inbox (each step once)."""
        task, me = self.task, self.worker_id
        self.advertise(client)
        assert self.crypto is not None
        if self._shares is None:
            roster = client.sec_roster(task.job_id, task.round, me, until=task.deadline_unix)
            if roster is None:
                raise SecureStepFailed(f"round {task.round} of {task.job_id}: the roster was not fixed before the "
                                       f"round's deadline")
            self.scale = roster.scale
            peers = {p.worker_id: PublicKeys(c_pk=p.cipher_key, s_pk=p.mask_key) for p in roster.peers}
            self._shares = self.crypto.share_keys(peers)
        client.sec_share(pb.SecShareRequest(job_id=task.job_id, round=task.round, worker_id=me, ciphertexts=[
            pb.SecCiphertext(peer=peer, data=data) for peer, data in sorted(self._shares.items())]))
        if self._inbox is None:
            inbox = client.sec_inbox(task.job_id, task.round, me, until=task.deadline_unix)
            if inbox is None:
                raise SecureStepFailed(f"round {task.round} of {task.job_id}: the inboxes were not fixed before the "
                                       f"round's deadline")
            self._inbox = {c.peer: c.data for c in inbox.ciphertexts}
        if self._failed is None:
            self._failed = self.crypto.open_inbox(self._inbox)
            for sender, why in self._failed.items():
                log.warning("worker %s: the shares %s sealed for it in round %d of %s fail: %s", me, sender,
                            task.round, task.job_id, why)
        if self.excluded is None:
            verdict = client.sec_verify(task.job_id, task.round, me, self._failed, until=task.deadline_unix)
            if verdict is None:
                raise SecureStepFailed(f"round {task.round} of {task.job_id}: the exclusions were not fixed before "
                                       f"the round's deadline")
            self.excluded = frozenset(verdict.excluded)

    def _advertisement(self) -> pb.SecAdvertiseRequest:
        keys = self._keys
        return pb.SecAdvertiseRequest(
            job_id=self.task.job_id, round=self.task.round, worker_id=self.worker_id,
            cipher_key=keys.c_pk if keys else b"", mask_key=keys.s_pk if keys else b"",
            num_samples=self.num_samples, ish=self.ish or 0.0, has_ish=self.ish is not None,
            noise_variance=self.ddp.mu if self.ddp is not None else 0.0)

    def mask(self, trained: Mapping[str, np.ndarray], global_state: Mapping[str, np.ndarray], spec: ModelSpec) -> None:
        """The masked ring vector of this worker's weighted update (once; a retry re-sends the same bytes)."""
        if self.masked is not None:
            return
        assert self.crypto is not None and self.excluded is not None
        vector = weighted_vector(trained, global_state, spec, self.scale)
        if vector.size != self.length:
            raise SecureStepFailed(f"the update has {vector.size} values, the round masks {self.length}")
        if self.steps is not None:
            self.steps.clear_update(worker_id=self.worker_id, task=self.task, vector=vector, scale=self.scale)
        self.masked = np.ascontiguousarray(self.crypto.masked_input(vector, self.excluded), dtype=self.dtype)
        if self.crypto.clipped:
            log.warning("worker %s: %d of %d weighted coordinates of round %d's update were clipped to ±%g before "
                        "masking", self.worker_id, self.crypto.clipped, vector.size, self.task.round,
                        self.crypto.params.clip)
        self._done("masked")

    def mask_integers(self, values: np.ndarray[Any, Any], *, bits: int) -> None:
        """Mask an input already in the ring of `bits` (distributed DP: the noised gradient sum), once."""
        if self.masked is not None:
            return
        assert self.crypto is not None and self.excluded is not None
        if values.size != self.length:
            raise SecureStepFailed(f"the gradient sum has {values.size} values, the round masks {self.length}")
        self.masked = np.ascontiguousarray(self.crypto.masked_integers(values, self.excluded, bits=bits),
                                           dtype=self.dtype)
        self._done("masked")

    def unmask(self, client: AggregatorClient) -> None:
        """Wait for the survivors to be named, then send the shares that remove their masks (once)."""
        task = self.task
        if self.unmasked:
            return
        assert self.crypto is not None
        self._done("uploaded")
        until = task.deadline_unix + UNMASK_WAIT_S  # a round closes at its deadline at the latest
        if self._unmask_shares is None:  # the crypto answers once; a retry re-sends the same shares
            named = client.sec_survivors(task.job_id, task.round, self.worker_id, until=until)
            if named is None:
                raise SecureStepFailed(f"round {task.round} of {task.job_id} named no survivors in time")
            short = below_quorum(len(named.survivors), task.participants, self.ddp.settings.quorum) if self.ddp else ""
            if short:  # distributed DP: a dishonest service's sum of fewer survivors would carry less noise
                raise SecureStepFailed(f"round {task.round} of {task.job_id}: {short}")
            self._unmask_shares = self.crypto.unmask(list(named.survivors), list(named.dropped))
        shares = self._unmask_shares
        client.sec_unmask(pb.SecUnmaskRequest(job_id=task.job_id, round=task.round, worker_id=self.worker_id,
                                              shares=[pb.SecShareValue(peer=peer, share=share)
                                                      for peer, share in sorted(shares.items())]))
        self.unmasked = True

    def _done(self, step: Step) -> None:
        if self.steps is not None:
            self.steps.step_done(worker_id=self.worker_id, task=self.task, step=step)

