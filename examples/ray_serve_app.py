"""DSpine speculative decoding behind Ray Serve: N replicas, each one vLLM engine with the
DSpine proposer, on 127.0.0.1 (docs/ray-serve.md). Needs `pip install -e ".[ray]"`.

    python examples/ray_serve_app.py --target T --draft D [--replicas N] [--port P]
    python examples/ray_serve_app.py --target T --draft D --smoke   # one request, then exit
    python examples/ray_serve_app.py --tiny-pair artifacts/tiny-pair --smoke   # small pair

Without a GPU it runs on CPU (float32, eager, 1 GiB KV cache: the small pair's settings).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

HOST = "127.0.0.1"
REPLICA_HEADER = "x-dspine-replica"  # vllm_dspine.serving.ray_serve.REPLICA_HEADER


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target model folder or hub id")
    p.add_argument("--draft", help="DSpine draft folder (config.json + safetensors)")
    p.add_argument("--tiny-pair", metavar="DIR",
                   help="write the small test pair to DIR and serve it (no --target/--draft)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs Ray may hand out (default: all); each replica takes one")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="Ray GPUs per replica (default: 1 when CUDA is present, else 0)")
    p.add_argument("--dtype", default=None, help="vLLM dtype (CPU default: float32)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="send one greedy completion, print it and the replica's spec-decode "
                        "counters, shut down")
    args = p.parse_args()
    if args.tiny_pair is None and not (args.target and args.draft):
        p.error("give --target and --draft, or --tiny-pair DIR")
    return args


def _on_cpu() -> bool:
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300) -> tuple[dict, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), r.headers.get(REPLICA_HEADER, "")


def _stats_of(base: str, replica: str, tries: int = 40) -> dict:
    """/stats of `replica`: Serve routes each GET to some replica, so ask a few times."""
    stats = {}
    for _ in range(tries):
        stats = _get(base + "/stats")
        if stats["replica"] == replica and stats["spec_decode"]["num_drafts"] > 0:
            break
        time.sleep(0.2)
    return stats


def _get(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    args = _parse_args()
    cpu = _on_cpu()
    # What scripts/env.sh sets; build_app forwards these to the replicas.
    from vllm_dspine.plugin.cpu_env import set_cpu_defaults

    set_cpu_defaults()

    target, draft = args.target, args.draft
    if args.tiny_pair:
        from vllm_dspine.pairs.tiny import write_tiny_pair

        pair = write_tiny_pair(args.tiny_pair, seed=0)
        target, draft = pair.target_dir, pair.draft_dir

    engine_kwargs: dict = {}
    if cpu:
        engine_kwargs.update(dtype="float32", enforce_eager=True,
                             gpu_memory_utilization=0.15, max_model_len=512)
    if args.dtype:
        engine_kwargs["dtype"] = args.dtype
    if args.max_model_len:
        engine_kwargs["max_model_len"] = args.max_model_len
    if args.served_model_name:
        engine_kwargs["served_model_name"] = args.served_model_name
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (0 if cpu else 1)
    actor_options = {"num_gpus": gpus} if gpus else {}

    import ray
    from ray import serve

    from vllm_dspine.serving.ray_serve import build_app

    app = build_app(target, draft, num_replicas=args.replicas,
                    engine_kwargs=engine_kwargs, ray_actor_options=actor_options)
    port = args.port or _free_port()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": HOST, "port": port})
        start = time.perf_counter()
        serve.run(app, name="dspine", route_prefix="/")
        base = f"http://{HOST}:{port}"
        model = args.served_model_name or target
        print(f"\nDSpine on Ray Serve: {args.replicas} replica(s) ready in "
              f"{time.perf_counter() - start:.0f} s at {base}")
        example = {"model": model, "prompt": "abcdefgh", "max_tokens": 32,
                   "temperature": 0}
        print(f"  curl -s {base}/v1/completions -H 'content-type: application/json' "
              f"-d '{json.dumps(example)}'")
        print(f"  curl -s {base}/stats     # spec-decode counters of one replica\n",
              flush=True)
        if args.smoke:
            try:
                answer, replica = _post(base + "/v1/completions",
                                        {**example, "ignore_eos": True})
            except urllib.error.HTTPError as e:
                print(f"request failed: HTTP {e.code}: {e.read().decode()}")
                return 1
            print(f"answer (replica {replica}):", json.dumps(answer, indent=2))
            stats = _stats_of(base, replica)
            print(f"stats of replica {stats['replica']}:",
                  json.dumps(stats["spec_decode"], indent=2))
            return 0
        print("serving; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
