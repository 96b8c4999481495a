"""Dataset and model plumbing the stages share: the source registry, chat tokenising with loss masks,
token shards, and model assets (finding and loading the target and its tokenizer)."""
