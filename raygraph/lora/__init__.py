"""Multi-LoRA below the coordinator: PEFT adapters read from disk (`adapter`) and written into
the model's persistent adapter slots (`slots`); the delta math is model/lora_ops.py."""

from raygraph.lora.adapter import LoRAAdapter, LoRAError, LoRAModule, read_adapter
from raygraph.lora.slots import clear_slot, enable_lora, load_adapter_into_slot

__all__ = ["LoRAAdapter", "LoRAError", "LoRAModule", "clear_slot", "enable_lora",
           "load_adapter_into_slot", "read_adapter"]
