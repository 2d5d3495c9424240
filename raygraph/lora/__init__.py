"""Multi-LoRA below the coordinator: PEFT adapters read from disk (`adapter`), cut into slot
images and copied into the model's persistent adapter slots (`slots`), recent images kept in
host memory (`warm`); the delta math is model/lora_ops.py."""

from raygraph.errors import LoRAError
from raygraph.lora.adapter import LoRAAdapter, LoRAModule, read_adapter
from raygraph.lora.slots import LoRASlots, SlotImage, append_slot_rows

__all__ = ["LoRAAdapter", "LoRAError", "LoRAModule", "LoRASlots", "SlotImage", "append_slot_rows",
           "read_adapter"]
