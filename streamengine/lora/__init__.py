"""LoRA adapters: reading and checking PEFT adapters, and the engine's registry of them."""
