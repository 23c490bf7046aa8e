"""One cycle's drafter-side operators, each Triton kernel beside its PyTorch reference
(the CPU path): the code bridge (`bridge*.py`), candidate retrieval (`retrieval*.py`)
and the serial refinement of the last write (`tail*.py`, the walk's kernel in
`tail_walk.py`); `aot.py` compiles the package's kernels for GPU targets without a GPU."""
