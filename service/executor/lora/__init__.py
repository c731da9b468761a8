"""LoRA adapters on the owned model: peft checkpoints read and checked (`adapter.py`), the linears that add the
deltas of a step's adapters (`layers.py`), and the registry of loaded adapters with the device slots a step's
adapters are copied into (`manager.py`)."""
