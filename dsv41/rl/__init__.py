"""Post-training: graded GRPO with reasoning effort, router replay, on-policy distillation, and a sandbox
orchestrator for verifiable rewards (training.md §8, spec-v41.md §10)."""
