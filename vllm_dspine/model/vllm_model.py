"""The DSpine drafter as a vLLM model class (`DSpineDraftModel`).

It is vLLM's DFlash Qwen3 drafter (context K/V precomputed from the fused target
features, block rows as queries, causal inside the block) with the code bridge after
every layer. The math is `model/drafter.py`'s (`block_forward`); this class only maps
it onto vLLM's layers, KV cache and flattened batch.

Block layout in the flattened batch (vLLM's DFlash query layout): each request
contributes `block_rows` consecutive rows, anchor first, so row i is an anchor iff
i % block_rows == 0. E.g. B = 4, two requests: [a m m m | b m m m].

Besides its final hidden states the forward produces the tail's inputs
(`LastWriteInputs`), which reach the proposer through `LastWriteHandover` (below says
why not as a return value).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import ignore_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.models.qwen3_dflash import (
    DFlashQwen3ForCausalLM,
    DFlashQwen3Model,
)

from vllm_dspine.hf_config import dspine_config_of
from vllm_dspine.kernels.cpu_gemm import Bf16Linear, native_bf16_cpu
from vllm_dspine.kernels.bridge_ref import BridgeWeights
from vllm_dspine.kernels.tail import LastWriteInputs


class _Weight(nn.Module):
    """A module holding one `weight`, so checkpoint names read `...{l}.weight`."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DSpineBridge(nn.Module):
    """`bridge.*` tensors of docs/design.md section 2."""

    def __init__(self, *, vocab_size: int, hidden_size: int, code_dim: int,
                 message_dim: int, num_layers: int, eps: float, dtype: torch.dtype):
        super().__init__()
        V, H, C, M = vocab_size, hidden_size, code_dim, message_dim
        self.eps = eps
        self.codebook = nn.Parameter(torch.empty(V, C, dtype=dtype), requires_grad=False)
        self.read = nn.ModuleList(_Weight(C, H, dtype=dtype) for _ in range(num_layers))
        self.gate_recv = _Weight(M, C, dtype=dtype)
        self.gate_pred = _Weight(M, C, dtype=dtype)
        self.value = _Weight(M, C, dtype=dtype)
        self.gate_bias = nn.Parameter(torch.empty(M, dtype=dtype), requires_grad=False)
        self.write = nn.ModuleList(_Weight(H, M, dtype=dtype) for _ in range(num_layers))

    def weights(self) -> BridgeWeights:
        return BridgeWeights(
            codebook=self.codebook,
            read=[m.weight for m in self.read],
            gate_recv=self.gate_recv.weight,
            gate_pred=self.gate_pred.weight,
            value=self.value.weight,
            gate_bias=self.gate_bias,
            write=[m.weight for m in self.write],
            eps=self.eps,
        )


class LastWriteHandover:
    """The tail's inputs from one block forward to the proposer that drafts with them.

    Not a return value because vLLM's DFlash `propose` (the caller of the model's
    forward) passes on only the final hidden states of the rows it samples, to the
    proposer's `_sample_draft_tokens` hook; anything else the forward returned would be
    dropped on the way. So the hand-over is this one slot, with one producer
    (`DSpineModel.forward` puts) and one consumer (`DSpineProposer._sample_draft_tokens`
    takes, within the same `propose` call). `take` empties it: a value is read once,
    and a forward whose drafts are never sampled (vLLM's warm-up and dummy runs) leaves
    one that the next forward replaces.
    """

    def __init__(self) -> None:
        self._inputs: LastWriteInputs | None = None

    def put(self, inputs: LastWriteInputs) -> None:
        self._inputs = inputs

    def take(self) -> LastWriteInputs:
        inputs, self._inputs = self._inputs, None
        if inputs is None:
            raise RuntimeError("DSpine: no block forward ran since the tail's inputs were "
                               "last taken")
        return inputs


def layer_gemms_in_bf16(option: str, model_dtype: torch.dtype) -> bool:
    """Whether the drafter's linear layers multiply in bf16 (`dspine_draft_gemm`):
    "auto" where the engine runs fp32 on a CPU with native bf16, "bf16" wherever the
    engine runs fp32 on CPU, "fp32" never. A bf16 engine's layers are bf16 already."""
    from vllm.platforms import current_platform

    if option == "fp32" or model_dtype != torch.float32 or not current_platform.is_cpu():
        return False
    return option == "bf16" or native_bf16_cpu()


class Bf16CpuLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized method whose CPU product runs in bf16 (`Bf16Linear`): vLLM's
    own dispatch runs first (it builds its fp32 handle and frees the weight), then the
    layer's `cpu_linear` is replaced by the product with the bf16 copy taken at load."""

    def __init__(self, weight: torch.Tensor):  # [N, K] the loaded weight
        super().__init__()
        self.bf16_linear = Bf16Linear(weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        linear = self.bf16_linear
        layer.cpu_linear = lambda x, weight, bias: linear(x, bias)


def use_bf16_layer_gemms(model: nn.Module) -> int:
    """Every unquantized linear layer of `model` to `Bf16CpuLinearMethod`, before vLLM's
    `process_weights_after_loading`; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and type(module.quant_method) is \
                UnquantizedLinearMethod and module.weight.dim() == 2:
            module.quant_method = Bf16CpuLinearMethod(module.weight)
            count += 1
    return count


@ignore_torch_compile
class DSpineModel(DFlashQwen3Model):
    """Eager on purpose: the bridge hands per-row state to the tail between calls,
    and the block forward is a single small launch sequence per step."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0,
                 prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id,
                         prefix=prefix)
        self.dspine = dspine_config_of(self.config)
        cfg = self.dspine
        self.bridge = DSpineBridge(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            code_dim=cfg.code_dim, message_dim=cfg.message_dim,
            num_layers=cfg.num_hidden_layers, eps=cfg.bridge_eps,
            dtype=vllm_config.model_config.dtype)
        self.last_write = LastWriteHandover()
        # Rows per request of the block being drafted: the proposer sets it per step
        # (a block's first n + 1 rows when only n drafts can be verified), before vLLM
        # calls the forward, whose arguments (ids, positions) cannot carry it.
        self.block_rows: int = cfg.block_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]  anchor / mask token ids
        positions: torch.Tensor,  # [num_tokens]
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from vllm_dspine.kernels.bridge import code_bridge

        if input_ids is None:
            raise ValueError("DSpine needs the block's token ids (anchor ids feed the "
                             "bridge codebook); inputs_embeds alone are not supported")
        if input_embeds is None:
            input_embeds = self.embed_input_ids(input_ids)
        num_tokens = input_ids.shape[0]
        B = self.block_rows
        rows = torch.arange(num_tokens, device=input_ids.device)
        is_anchor = rows % B == 0  # [num_tokens]
        weights = self.bridge.weights()
        last = len(self.layers) - 1

        x = input_embeds
        for l, layer in enumerate(self.layers):
            # residual=None: the layer's input RMSNorm consumes x' (docs/design.md section 1.3).
            hidden, residual = layer(positions=positions, hidden_states=x, residual=None)
            x = hidden + residual  # post-MLP residual
            x_new, codes, rms = code_bridge(x, l, weights, input_ids, is_anchor)
            if l == last:
                # Whole blocks only: rows past R * B are padding of the batch.
                R = num_tokens // B
                n = R * B
                self.last_write.put(LastWriteInputs(
                    pre_write_state=x[:n].view(R, B, x.shape[-1]),  # [R, B, H]
                    codes=codes[:n].view(R, B, codes.shape[-1]),  # [R, B, C]
                    rms=rms[:n].view(R, B),  # [R, B]
                    anchor_ids=input_ids[:n:B]))  # [R]  what the bridge read at row 0
            x = x_new
        return self.norm(x)


class DSpineDraftForCausalLM(DFlashQwen3ForCausalLM):
    """Registered as `DSpineDraftModel` (and vLLM's DFlash-prefixed alias)."""

    model_cls = DSpineModel

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Recorded by the front end's validation (proposer/validation.py); None for a draft
        # that is not a local folder. Checked here, before vLLM's loader lists the files.
        self._dspine_folder = getattr(self.config, "dspine_folder", None)
        if self._dspine_folder is not None:
            from vllm_dspine.model.checkpoint import check_folder_unchanged

            check_folder_unchanged(self._dspine_folder)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        from vllm_dspine.model.checkpoint import (
            check_files_unchanged,
            check_loaded_tensors,
            check_tensor_shapes,
        )

        when = "while vLLM was loading the draft weights"
        try:
            # vLLM's iterator lists and opens the files lazily, here.
            tensors = dict(weights)
        except Exception:
            if self._dspine_folder is not None:  # the folder changed under the loader?
                check_files_unchanged(self._dspine_folder, when=when)
            raise
        where = str(self.draft_model_config.model)
        check_tensor_shapes(self.model.dspine, {k: tuple(v.shape) for k, v in tensors.items()},
                            where=where)
        if self._dspine_folder is not None:
            # What was read is what was validated (a change while vLLM read the files).
            check_loaded_tensors(self._dspine_folder,
                                 {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
                                 when=when)
            check_files_unchanged(self._dspine_folder, when=when)
        loaded = super().load_weights(tensors.items())
        option = (getattr(self.config, "dspine_options", None) or {}).get(
            "dspine_draft_gemm", "auto")
        self.layer_gemm_dtype = torch.float32
        if layer_gemms_in_bf16(option, self.model.norm.weight.dtype):
            if use_bf16_layer_gemms(self.model):
                self.layer_gemm_dtype = torch.bfloat16
        return loaded
