"""DSpine behind Ray Serve: N replicas, each vLLM's own OpenAI server around one engine
with the DSpine proposer (docs/ray-serve.md). Needs `pip install -e ".[ray]"`.

    python examples/ray_serve_dspine.py --pair smollm2 --replicas 2      # the small real pair
    python examples/ray_serve_dspine.py --pair tiny --replicas 2 --smoke # synthetic, seconds
    python examples/ray_serve_dspine.py --target T --draft D --replicas 2 -- --max-model-len 8192

`--pair NAME` writes (or reuses) `python -m vllm_dspine.pairs NAME --out DIR`. Flags after
`--` are `vllm serve` flags for every replica. `--smoke` sends one chat and one text
completion, prints each replica's vllm:spec_decode_* counters and exits; otherwise it
serves until Ctrl-C. By default a fresh local Ray instance is started and Serve's proxy
listens on 127.0.0.1; `--address auto` joins a running cluster instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

REPLICA_HEADER = "x-dspine-replica"  # vllm_dspine.serving.ray_serve.REPLICA_HEADER
APP_NAME = "dspine"

# `vllm serve` flags used on a machine without a GPU (the project's CPU settings);
# flags given after `--` come later and win.
CPU_SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.15"]
PAIR_MAX_MODEL_LEN = {"tiny": 512, "smollm2": 2048}


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", choices=sorted(PAIR_MAX_MODEL_LEN),
                   help="serve a project pair (written by python -m vllm_dspine.pairs)")
    p.add_argument("--pair-dir", default=None,
                   help="where the pair is written / reused (default: artifacts/<pair>-pair)")
    p.add_argument("--target", help="target model folder or hub id (instead of --pair)")
    p.add_argument("--draft", help="DSpine draft folder (instead of --pair)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--name", default=None, help="served model name (default: the pair's "
                   "name, or the target)")
    p.add_argument("--address", default="local",
                   help="Ray cluster: 'local' starts a fresh one (default); 'auto' or an "
                        "address joins a running cluster")
    p.add_argument("--host", default="127.0.0.1", help="where Serve's proxy listens")
    p.add_argument("--port", type=int, default=0, help="proxy port (0: a free one)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs a fresh local Ray instance hands out (each replica takes one)")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="Ray GPUs per replica (default: 1 where CUDA is present, else 0)")
    p.add_argument("--smoke", action="store_true",
                   help="one chat and one completion, per-replica counters, then exit")
    args = p.parse_args(argv)
    if bool(args.pair) == bool(args.target or args.draft):
        p.error("give --pair NAME, or --target and --draft")
    if args.target and not args.draft or args.draft and not args.target:
        p.error("--target and --draft go together")
    return args, serve_args


def _write_pair(name: str, out: str) -> tuple[str, str]:
    from vllm_dspine.pairs.__main__ import main as pairs_main

    if pairs_main([name, "--out", out]) != 0:
        raise SystemExit(f"could not write the {name} pair into {out} (see above)")
    return os.path.join(out, "target"), os.path.join(out, "draft")


def _request(url: str, body: dict | None = None, timeout: float = 600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode(), r.headers.get(REPLICA_HEADER, "")


def _smoke(base: str, model: str, replicas: int) -> int:
    from vllm_dspine.serving.metrics import spec_decode_counters_of_page

    chat = {"model": model, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user",
                          "content": "Write a Python function that reverses a string."}]}
    completion = {"model": model, "prompt": "The capital of France is", "max_tokens": 32,
                  "temperature": 0}
    try:
        text, replica = _request(base + "/v1/chat/completions", chat)
        answer = json.loads(text)["choices"][0]["message"]["content"]
        print(f"chat (replica {replica}):\n{answer}\n")
        text, replica = _request(base + "/v1/completions", completion)
        print(f"completion (replica {replica}): {json.loads(text)['choices'][0]['text']!r}\n")
    except urllib.error.HTTPError as e:
        print(f"request failed: HTTP {e.code}: {e.read().decode()}")
        return 1
    # Serve routes each GET to one replica; ask until every replica has answered.
    pages: dict[str, dict] = {}
    deadline = time.time() + 60
    while len(pages) < replicas and time.time() < deadline:
        page, replica = _request(base + "/metrics", timeout=30)
        pages[replica] = spec_decode_counters_of_page(page)
    for replica, counters in sorted(pages.items()):
        print(f"replica {replica}: " + json.dumps(counters))
    return 0


def main(argv: list[str] | None = None) -> int:
    args, extra_serve_args = _parse_args(sys.argv[1:] if argv is None else argv)
    from vllm_dspine.cpu_env import has_cuda_gpu, set_cpu_defaults

    set_cpu_defaults()  # what scripts/env.sh sets; build_app forwards it to the replicas
    gpu = has_cuda_gpu()
    if args.pair:
        target, draft = _write_pair(args.pair, args.pair_dir or
                                    os.path.join("artifacts", f"{args.pair}-pair"))
        model = args.name or args.pair
        serve_args = ["--max-model-len", str(PAIR_MAX_MODEL_LEN[args.pair])]
    else:
        target, draft, serve_args = args.target, args.draft, []
        model = args.name or target
    serve_args = [*(CPU_SERVE_ARGS if not gpu else []), *serve_args,
                  "--served-model-name", model, *extra_serve_args]
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (1 if gpu else 0)

    import ray
    from ray import serve

    from vllm_dspine.serving.openai_server import free_port
    from vllm_dspine.serving.ray_serve import build_app

    app = build_app(target, draft, num_replicas=args.replicas, serve_args=serve_args,
                    ray_actor_options={"num_gpus": gpus} if gpus else {})
    local = args.address == "local"
    port = args.port or free_port(args.host)
    ray.init(address=args.address, num_cpus=args.num_cpus if local else None,
             include_dashboard=False if local else None)
    try:
        serve.start(http_options={"host": args.host, "port": port})
        start = time.perf_counter()
        serve.run(app, name=APP_NAME, route_prefix="/")
        base = f"http://{args.host}:{port}"
        print(f"\nDSpine on Ray Serve: {args.replicas} replica(s) of {target} ready in "
              f"{time.perf_counter() - start:.0f} s at {base}")
        example = {"model": model, "max_tokens": 64,
                   "messages": [{"role": "user", "content": "Hello!"}]}
        print(f"  curl -s {base}/v1/chat/completions -H 'content-type: application/json' "
              f"-d '{json.dumps(example)}'")
        print(f"  curl -s {base}/metrics | grep vllm:spec_decode   # one replica's page\n",
              flush=True)
        if args.smoke:
            return _smoke(base, model, args.replicas)
        print("serving; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
