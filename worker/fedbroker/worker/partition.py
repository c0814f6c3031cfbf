"""Split one labelled data set among simulated clients (IID, Dirichlet label skew, k classes each).

Pure numpy. All randomness comes from `np.random.default_rng(seed)`, so every machine that runs
the same call gets the same partition and a demo's worker *i* can load its own share without any
coordination. Each sample lands in exactly one client's index array; the arrays are sorted.
"""

from __future__ import annotations

import math

import numpy as np

from fedbroker.errors import ConfigError

SCHEMES = ("iid", "dirichlet", "classes")
MAX_DIRICHLET_ATTEMPTS = 1000


def partition(
    labels: np.ndarray,
    *,
    scheme: str,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Return one sorted int64 index array per client; together they cover every sample once.

    - "iid": a shuffled split into near-equal parts.
    - "dirichlet": for every class, the shares of the clients are drawn from Dir(alpha·1); small
      alpha concentrates a class on few clients. Whole draws are repeated (at most
      MAX_DIRICHLET_ATTEMPTS times) until every client holds at least `min_size` samples.
    - "classes": DWFed's 1-class / 2-class non-IID. The data are cut into num_clients·k
      single-class shards (shards given to classes in proportion to their size, each class at least
      one) and each client gets k shards of distinct classes whenever no class has more shards than
      there are clients. With fewer shards than classes, single-class shards are impossible; then
      each shard is a union of whole classes (size-balanced).
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError("labels", f"must be a 1-D integer array, got {labels.dtype} with shape {labels.shape}")
    if scheme not in SCHEMES:
        raise ConfigError("scheme", f"unknown partition scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ConfigError("num_clients", f"must be an integer >= 1, got {num_clients!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ConfigError("min_size", f"must be an integer >= 0, got {min_size!r}")
    n = len(labels)
    if n < num_clients * min_size:
        raise ConfigError(
            "num_clients",
            f"{n} samples cannot give {num_clients} clients at least min_size={min_size} samples each",
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), num_clients)
    elif scheme == "dirichlet":
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ConfigError("alpha", f"must be a finite number > 0, got {alpha!r}")
        parts = _dirichlet(labels, num_clients=num_clients, alpha=float(alpha), min_size=min_size, rng=rng)
    else:
        k = classes_per_client
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ConfigError("classes_per_client", f"must be an integer >= 1, got {k!r}")
        if n < num_clients * k:
            raise ConfigError(
                "classes_per_client",
                f"{n} samples cannot be cut into num_clients·classes_per_client = {num_clients * k} shards",
            )
        parts = _classes(labels, num_clients=num_clients, k=int(k), rng=rng)
    out = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    smallest = min(len(p) for p in out)
    if smallest < min_size:
        raise ConfigError(
            "min_size",
            f"scheme {scheme!r} gave a client only {smallest} samples (< min_size={min_size}); "
            "use fewer clients or fewer classes_per_client",
        )
    return out


def _dirichlet(
    labels: np.ndarray, *, num_clients: int, alpha: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(MAX_DIRICHLET_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in by_class:
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for client, chunk in enumerate(np.split(rng.permutation(members), cuts)):
                parts[client].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        if min(len(p) for p in merged) >= min_size:
            return merged
    raise ConfigError(
        "alpha",
        f"no Dirichlet(alpha={alpha}) draw in {MAX_DIRICHLET_ATTEMPTS} attempts gave all {num_clients} "
        f"clients at least min_size={min_size} samples; raise alpha, or lower num_clients or min_size",
    )


def _classes(labels: np.ndarray, *, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(labels)
    members = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    sizes = np.array([len(m) for m in members])
    num_shards = num_clients * k
    shards: list[np.ndarray] = []
    shard_class: list[int] = []
    if num_shards >= len(classes):
        for ci, count in enumerate(_apportion(sizes, num_shards)):
            for chunk in np.array_split(members[ci], count):
                shards.append(chunk)
                shard_class.append(ci)
    else:
        # Fewer shards than classes: whole classes go to the currently smallest shard, largest first.
        groups: list[list[int]] = [[] for _ in range(num_shards)]
        load = np.zeros(num_shards, dtype=np.int64)
        for ci in sorted(rng.permutation(len(classes)), key=lambda c: -sizes[c]):
            target = int(np.argmin(load))
            groups[target].append(ci)
            load[target] += sizes[ci]
        for group in groups:
            shards.append(np.concatenate([members[ci] for ci in group]))
            shard_class.append(group[0])  # shards are never shared, so one tag per shard suffices

    # Deal the class-sorted shards round-robin (shard j -> client j mod C): a client then holds two
    # shards of one class only if that class has more shards than there are clients. Random swaps
    # that never add a clash then mix the pairings, so clients do not come in fixed class pairs;
    # finally the client order is shuffled.
    rank = rng.permutation(len(classes))
    order = sorted(range(len(shards)), key=lambda j: rank[shard_class[j]])
    hands = [[order[j] for j in range(c, num_shards, num_clients)] for c in range(num_clients)]

    def clashes(hand: list[int]) -> int:
        return len(hand) - len({shard_class[s] for s in hand})

    if num_clients > 1:
        for _ in range(4 * num_shards):
            a, b = (int(v) for v in rng.choice(num_clients, size=2, replace=False))
            i, j = int(rng.integers(k)), int(rng.integers(k))
            new_a = hands[a][:i] + [hands[b][j]] + hands[a][i + 1 :]
            new_b = hands[b][:j] + [hands[a][i]] + hands[b][j + 1 :]
            if clashes(new_a) + clashes(new_b) <= clashes(hands[a]) + clashes(hands[b]):
                hands[a], hands[b] = new_a, new_b
    hands = [hands[c] for c in rng.permutation(num_clients)]
    return [np.concatenate([shards[s] for s in hand]) for hand in hands]


def _apportion(sizes: np.ndarray, total: int) -> list[int]:
    """Split `total` shards among classes: at least one each, the rest by largest remainder of size."""
    counts = np.ones(len(sizes), dtype=np.int64)
    ideal = sizes / sizes.sum() * total
    for _ in range(total - len(sizes)):
        room = np.where(counts < sizes, ideal - counts, -np.inf)  # a shard needs at least one sample
        counts[int(np.argmax(room))] += 1
    return [int(c) for c in counts]
