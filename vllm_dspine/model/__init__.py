"""The drafter: its checkpoint format (`checkpoint.py`), the model in plain PyTorch
(`drafter.py`, the one statement of the forward), the vLLM model class
(`vllm_model.py`) and what it keeps resident (`memory.py`)."""
