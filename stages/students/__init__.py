"""The student kinds (docs/architecture.md, "The student kind"): student_kind.py, compact.py, lora.py."""
