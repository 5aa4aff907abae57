"""What a weight update costs: update_weights_from_disk and update_weights_from_distributed (a
broadcast a tensor, and SGLang's flattened_bucket) on a served model, end to end through the
Engine and split into its parts (read or transfer, check, copy + repack), against issue 51's
target: twice the time to read the bytes moved once from memory, plus the copy and repack. Over
gloo the bytes also cross TCP (loopback here), which alone takes longer than that: the table
prints that wire's time for the same bytes beside it.

    tandem bench weights [--model-path PATH] [--dtype bfloat16] [--repeats 3] [--output-file out.json]

A GGUF model (the default) is first written as the Hugging Face folder a trainer saves (safetensors
in the served dtype, launch/make_tiny_model.py); that folder is served, dequantized, and updated from.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import torch

from tandem.runtime.model_files import cache_dir, default_model_path, file_cache_key, is_gguf
from tandem.runtime.model import weight_update
from tandem.runtime.model.loader import load_config, load_hf_weights, load_model
from tandem.runtime.model.tensor_parallel import SINGLE
from tandem.runtime.model.weight_sync import WeightsGroup, broadcast, flatten, init_weights_group, receive


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memory_bandwidth(n_bytes: int = 1 << 30) -> float:
    """Bytes per second of one streaming copy (read + write counted once each, as a read-once bound)."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _best(lambda: dst.copy_(src), 5)
    return 2 * n_bytes / seconds


def tcp_loopback_s(n_bytes: int, repeats: int) -> float:
    """Seconds to move `n_bytes` once over a TCP socket on loopback (a sender and a receiver thread,
    a warm receive buffer): the wire gloo runs on between processes on one CPU host, the bound of
    any transfer over it."""
    payload = bytes(n_bytes)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    inbox = memoryview(bytearray(n_bytes))

    def receive() -> None:
        got = 0
        while got < n_bytes:
            got += conn.recv_into(inbox[got:], n_bytes - got)

    def once() -> None:
        reader = threading.Thread(target=receive)
        reader.start()
        client.sendall(payload)
        reader.join()
    try:
        once()  # the receive buffer's pages touched
        return _best(once, repeats)
    finally:
        for s in (conn, client, server):
            s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parts(model_path: str, dtype: torch.dtype, repeats: int) -> dict:
    """In-process: the phases of an update into a packed model, as the scheduler runs them."""
    cfg = load_config(model_path)
    model = load_model(model_path, dtype)
    model.pack_weights()
    weights = load_hf_weights(model_path, cfg)
    served = {n: t.to(dtype) for n, t in weights.items()}
    bytes_moved = sum(t.numel() * t.element_size() for t in served.values())
    read = _best(lambda: load_hf_weights(model_path, cfg), repeats)
    check = _best(lambda: weight_update.check(model, cfg, SINGLE, served.items()), repeats)
    checked = weight_update.check(model, cfg, SINGLE, served.items())
    apply = _best(lambda: weight_update.apply(model, checked), repeats)
    groups = _loopback_groups()
    per_tensor = _best(lambda: _loopback(groups, served, flattened=False), repeats)
    flat = _best(lambda: _loopback(groups, served, flattened=True), repeats)
    wire = tcp_loopback_s(bytes_moved, repeats)
    return {"bytes": bytes_moved, "read_from_disk_s": read, "tcp_loopback_s": wire, "transfer_gloo_s": per_tensor,
            "transfer_gloo_flat_s": flat, "check_s": check, "copy_and_repack_s": apply}


def _loopback_groups() -> dict[int, WeightsGroup]:
    port, groups = _free_port(), {}
    joins = [threading.Thread(target=lambda r=r: groups.update({r: init_weights_group("127.0.0.1", port, r, 2, "b")}))
             for r in (0, 1)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    return groups


def _loopback(groups: dict[int, WeightsGroup], tensors: dict[str, torch.Tensor], flattened: bool) -> None:
    """The tensors over a two-rank gloo group on loopback, as a trainer sends them and the scheduler
    receives them (weight_sync.receive): one broadcast each, or one of them all."""
    specs = [(t.dtype, list(t.shape)) for t in tensors.values()]
    bucket = flatten(list(tensors.values())) if flattened else None  # filled before the transfer, as a trainer does
    recv = threading.Thread(target=lambda: receive(groups[1], specs, torch.device("cpu"), flattened))
    recv.start()
    if bucket is not None:
        broadcast(groups[0], bucket)
    else:
        for t in tensors.values():
            broadcast(groups[0], t)
    recv.join()


def end_to_end(model_path: str, dtype: str, repeats: int) -> dict:
    """Through the Engine: the whole call, scheduler, forward thread and cache flush included. The
    trainer sends the served dtype's tensors, one broadcast each and as one flattened bucket."""
    from tandem.runtime.engine import Engine

    cfg = load_config(model_path)
    weights = {n: t.to(getattr(torch, dtype)) for n, t in load_hf_weights(model_path, cfg).items()}
    names = list(weights)
    with Engine(model_path, dtype=dtype, log_level="warning") as engine:
        disk = _best(lambda: engine.update_weights_from_disk(model_path), repeats)
        port, trainer = _free_port(), {}
        joining = threading.Thread(target=lambda: trainer.update(g=init_weights_group("127.0.0.1", port, 0, 2, "e")))
        joining.start()
        engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name="e")
        joining.join()

        bucket = flatten([weights[n] for n in names])  # a trainer fills its bucket before it calls the update

        def distributed(load_format: str | None) -> None:
            send = ((lambda: broadcast(trainer["g"], bucket)) if load_format
                    else (lambda: [broadcast(trainer["g"], weights[n]) for n in names]))
            sender = threading.Thread(target=send)
            sender.start()
            ok, message = engine.update_weights_from_distributed(names, [str(weights[n].dtype) for n in names],
                                                                 [list(weights[n].shape) for n in names], "e",
                                                                 load_format=load_format)
            sender.join()
            assert ok, message
        per_tensor = _best(lambda: distributed(None), repeats)
        flat = _best(lambda: distributed("flattened_bucket"), repeats)
    return {"engine_update_from_disk_s": disk, "engine_update_from_distributed_s": per_tensor,
            "engine_update_from_distributed_flat_s": flat}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="an HF folder or GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    model_path = args.model_path or default_model_path()
    if is_gguf(model_path):  # trainers save HF checkpoints; a GGUF's blocks are not what they write
        from tandem.launch.make_tiny_model import build_truncated_model

        folder = cache_dir() / f"bench-weights-{file_cache_key(model_path)}-{args.dtype}"
        model_path = str(build_truncated_model(model_path, folder, load_config(model_path).num_layers, args.dtype))
    result = {"model": model_path, "dtype": args.dtype, "bandwidth_gb_s": memory_bandwidth() / 1e9,
              **parts(model_path, getattr(torch, args.dtype), args.repeats),
              **end_to_end(model_path, args.dtype, args.repeats)}
    read_once = result["bytes"] / (result["bandwidth_gb_s"] * 1e9)
    result["read_once_s"] = read_once
    target = 2 * read_once + result["copy_and_repack_s"]
    result["target_s"] = target
    # gloo between processes runs on TCP: over a wire, the bytes cross it once on top of the target
    result["target_over_tcp_s"] = target + result["tcp_loopback_s"]
    ms = lambda key: f"{result[key] * 1e3:.1f} ms"  # noqa: E731
    rows = [("bytes moved", f"{result['bytes'] / 1e6:.1f} MB"),
            ("memory bandwidth (copy)", f"{result['bandwidth_gb_s']:.1f} GB/s"),
            ("read the bytes once", f"{read_once * 1e3:.1f} ms"),
            ("read from disk", ms("read_from_disk_s")),
            ("the bytes once over TCP loopback (the wire)", ms("tcp_loopback_s")),
            ("transfer over gloo, a broadcast a tensor", ms("transfer_gloo_s")),
            ("transfer over gloo, one flattened bucket", ms("transfer_gloo_flat_s")),
            ("check", ms("check_s")),
            ("copy + repack (in place)", ms("copy_and_repack_s")),
            ("target: 2 x read once + copy + repack", f"{target * 1e3:.1f} ms"),
            ("  ... + the bytes once over TCP (distributed)", ms("target_over_tcp_s")),
            ("Engine update_weights_from_disk", ms("engine_update_from_disk_s")),
            ("Engine update_weights_from_distributed", ms("engine_update_from_distributed_s")),
            ("  ... load_format=flattened_bucket", ms("engine_update_from_distributed_flat_s"))]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>12}")
    print(json.dumps(result))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
