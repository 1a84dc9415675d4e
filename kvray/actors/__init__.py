"""Workers: model shard, KV cache shard, model runner (in-process or as Ray actors)."""
