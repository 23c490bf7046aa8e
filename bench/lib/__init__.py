"""Code the benchmark scripts share.

- `engines`: the methods (name -> vLLM speculative config) and the engine runner (one
  vLLM `LLM` per method with the step profile on; settings measured one after the other
  or interleaved round by round);
- `report`: the facts of a table's header (machine, versions), the writer of a section
  of docs/benchmarks.md, and the tables and plots of engine rows;
- `workloads`: the prompts (HumanEval as data, a chat set).
"""
