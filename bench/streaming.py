"""Benchmark 2: streaming a model over gRPC on loopback, against a raw TCP socket moving the same bytes.

The aggregation service (RoundBook + `serve` on port 0) runs in a child process, so the receiver's
memory of an upload is the child's peak RSS and the receiver of a download is this process. The
client is the real `AggregatorClient`. An upload is the whole `UploadUpdate` call: header checks,
chunks into a row of the round's running mean, SHA-256 on both sides and the finite-values check,
i.e. everything a worker waits for before its receipt, in a round after the first (as in a running job). The baseline is a raw TCP socket on loopback
between this process and another child, with the same bytes sent with `sendall` and received with
`recv_into` into a fresh buffer, timed the same way.

`python -m bench.streaming --serve` and `--raw` are the two children.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat, current_rss_bytes, peak_rss_bytes, repeat, reset_peak_rss

MB = 1e6


def model_spec(width: int) -> dict[str, Any]:
    """One Linear(width → width): (width² + width)·4 bytes (5000 → 100 MB, 10000 → 400 MB)."""
    return {"input_shape": [width], "layers": [{"type": "Linear", "in_features": width, "out_features": width}]}


def make_tensors(width: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"0.weight": rng.standard_normal((width, width), dtype=np.float32),
            "0.bias": rng.standard_normal(width, dtype=np.float32)}


def cpu_seconds(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----- children -------------------------------------------------------------------------------------


def serve_child() -> None:
    from fedbroker.aggregators.round_book import RoundBook
    from fedbroker.aggregators.service import serve
    from fedbroker.app.glibc_malloc import keep_freed_memory

    keep_freed_memory()  # as `fedbroker aggregator` does at start (fedbroker.app.launch.start_aggregator)
    server, port = serve(RoundBook())  # the deployment's thread budget (fedbroker.rpc.callguard.CallLimits)
    print(port, flush=True)
    _control_loop()  # until the parent closes our stdin
    server.stop(grace=0)


def malloc_trim() -> None:
    """Give freed heap memory back to the OS, so the next RSS delta counts a transfer's own memory."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def _control_loop() -> None:
    for line in sys.stdin:
        if line.strip() == "trim":
            malloc_trim()
            print("ok", flush=True)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def raw_child() -> None:
    """'U' + size: receive size bytes into a fresh buffer, answer one byte. 'D' + size: send size bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    payload = bytearray(os.urandom(1 << 20))
    cache: dict[int, memoryview] = {}
    def watch_parent() -> None:
        _control_loop()
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    while True:
        conn, _ = listener.accept()
        with conn:
            head = _recv_exact(conn, 9)
            size = int.from_bytes(head[1:], "little")
            if head[:1] == b"U":
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")
                del view, buf
            else:
                if size not in cache:
                    cache.clear()
                    cache[size] = memoryview(bytearray(payload) * (size // len(payload) + 1))[:size]
                conn.sendall(cache[size])


def _spawn(flag: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.streaming", flag], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        raise RuntimeError(f"bench.streaming {flag} did not start")
    return proc, int(line)


def _trim(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("trim\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "ok":
        raise RuntimeError("child did not trim")


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    except Exception:
        proc.kill()
        proc.wait()


# ----- raw socket baseline ---------------------------------------------------------------------------


def raw_upload(port: int, data: memoryview) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"U" + len(data).to_bytes(8, "little"))
        s.sendall(data)
        if s.recv(1) != b"k":
            raise ConnectionError("no ack")


def raw_download(port: int, size: int) -> bytearray:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"D" + size.to_bytes(8, "little"))
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            k = s.recv_into(view[got:])
            if not k:
                raise ConnectionError("short download")
            got += k
        return buf


# ----- the benchmark --------------------------------------------------------------------------------


def run(*, quick: bool) -> Section:
    from fedbroker.app.glibc_malloc import keep_freed_memory
    from fedbroker.job.settings import sections_settings
    from fedbroker.rpc import codec
    from fedbroker.rpc.aggregation_client import AggregatorClient

    keep_freed_memory()  # this process is the worker's side (downloads land here), as `fedbroker worker` sets it
    started = time.perf_counter()
    section = Section(
        "streaming", "2. Weight streaming over gRPC (loopback)",
        "Upload (`UploadUpdate`: chunks + SHA-256 + validation + fold into the running mean) and download "
        "(`DownloadGlobalModel`) of one model through the real aggregation service in a child process, against a raw "
        "TCP socket moving the same bytes between the same two processes. Receiver peak = peak RSS of the receiving "
        "process during the transfer minus its RSS just before, in units of the model size. CPU = user+sys seconds "
        f"of client and server per transfer. Chunk size {codec.CHUNK_BYTES >> 20} MiB.",
    )
    widths = [2500] if quick else [5000, 10000]  # 25 MB (quick), 100 MB, 400 MB
    repeats = 2 if quick else 3
    rng = np.random.default_rng(7)
    server, port = _spawn("--serve")
    raw, raw_port = _spawn("--raw")
    target = f"127.0.0.1:{port}"
    worst: list[tuple[float, str]] = []
    peaks: list[tuple[float, str]] = []
    try:
        client = AggregatorClient(target, transfer_timeout_s=600.0)
        for width in widths:
            import json

            tensors = make_tensors(width, rng)
            size = sum(a.nbytes for a in tensors.values())
            label = f"{size / MB:.0f} MB"
            job = f"bench-{width}"
            spec_json = json.dumps(model_spec(width))
            uploads = repeats + 1
            client.install_job(sections_settings(job))
            client.put_global(job, 1, spec_json, tensors)
            flat = np.concatenate([a.reshape(-1) for a in tensors.values()]).view(np.uint8).data
            rounds = iter(range(1, uploads + 1))
            current = [0]

            def next_round(job: str = job) -> None:
                """Untimed: close the last round and open the next, as a job's rounds follow one another."""
                if current[0]:
                    client.close_round(job, current[0])
                current[0] = next(rounds)
                client.open_round(job, current[0], ["w"], time.time() + 3600, seed=0)

            def upload(job: str = job) -> None:
                client.upload(job_id=job, round=current[0], worker_id="w", num_samples=100, tensors=tensors)

            def download() -> None:
                client.download(job)

            ops: dict[str, dict[str, Any]] = {}
            plan: list[tuple[str, Any, int | str]] = [
                ("upload", upload, server.pid),
                ("download", download, "self"),
                ("raw upload", lambda: raw_upload(raw_port, flat), raw.pid),
                ("raw download", lambda: raw_download(raw_port, size), "self"),
            ]
            for op, fn, receiver in plan:
                times, mems, cpus = [], [], []
                child = raw if op.startswith("raw") else server
                for i in range(repeats + 1):
                    if op == "upload":
                        next_round()
                    malloc_trim()
                    _trim(child)
                    ok = reset_peak_rss(receiver)
                    before = current_rss_bytes(receiver)
                    cpu0 = cpu_seconds() + cpu_seconds(server.pid if not op.startswith("raw") else raw.pid)
                    elapsed = repeat(fn, repeats=1, warmup=0)[0]
                    cpu1 = cpu_seconds() + cpu_seconds(server.pid if not op.startswith("raw") else raw.pid)
                    peak = peak_rss_bytes(receiver) - before if ok else float("nan")
                    if i:  # the first one warms up connections, allocators and the round's accumulator
                        times.append(elapsed)
                        mems.append(peak / size)
                        cpus.append(cpu1 - cpu0)
                ops[op] = {"time": Stat.of(times, "s"), "mem": Stat.of(mems, "× model"), "cpu": Stat.of(cpus, "s")}
            for op in ("upload", "download", "raw upload", "raw download"):
                t = ops[op]["time"]
                base = ops[f"raw {op}"]["time"] if not op.startswith("raw") else None
                ratio = base.median / t.median if base is not None else None
                section.rows.append({
                    "model": label, "transfer": op, "time (s)": t, "MB/s": t.inverse(size / MB, "MB/s"),
                    "% of raw socket": None if ratio is None else round(100 * ratio, 1),
                    "receiver peak (× model)": ops[op]["mem"], "CPU (s)": ops[op]["cpu"],
                })
                if ratio is not None:
                    worst.append((ratio, f"{op} {label}"))
                    peaks.append((ops[op]["mem"].max, f"{op} {label}"))
        client.close()
    finally:
        _stop(server)
        _stop(raw)
    low, where = min(worst)
    section.goals.append(Goal("gRPC throughput, % of the raw socket", round(100 * low, 1), "≥ 50 %", low >= 0.5,
                              f"worst: {where}"))
    high, where_mem = max(peaks)
    section.goals.append(Goal("receiver peak memory (× model)", round(high, 2), "≤ ~2×", high <= 2.2,
                              f"worst: {where_mem}"))
    section.notes.append(
        "Each upload is the one upload of a new round of the job (the last round closed, untimed, before it): the "
        "steady state of a job, whose rounds receive into the rows of the round before. Upload receiver memory "
        "excludes what the service keeps between uploads (the global models, those rows and the running sum, "
        "allocated by the first round): the peak is what one transfer adds."
    )
    section.notes.append(
        "The service hashes a global version once for all its downloads (every worker fetches the same one): the "
        "warm-up download pays for it, overlapped with sending; the timed ones send the digest it computed."
    )
    section.seconds = time.perf_counter() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--serve", action="store_true")
    group.add_argument("--raw", action="store_true")
    args = parser.parse_args()
    if args.serve:
        serve_child()
    else:
        raw_child()


if __name__ == "__main__":
    main()
