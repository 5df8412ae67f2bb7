"""Text, torch-free: ``tokenization`` (prompt tokenizer and chat templates) and ``detokenizer`` (incremental)."""
