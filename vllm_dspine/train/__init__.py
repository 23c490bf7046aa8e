"""Distillation: text and features from the target (`target_data.py`), the training
loop (`distill.py`) and offline acceptance (`acceptance.py`)."""
