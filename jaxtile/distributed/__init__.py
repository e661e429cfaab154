"""Attention spread over devices: batch- and head-sharded calls run shard by shard
(`jaxtile.distributed._sharding`), and ring attention over sequences sharded across a
mesh axis (`jaxtile.distributed.ring`)."""
