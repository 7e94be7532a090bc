"""Multi-LoRA: PEFT adapters on one base model, chosen per request and mixed in one batch
(docs/architecture.md)."""
