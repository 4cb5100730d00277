"""hixl-master: the registry's home and the KV store's master.

`master` (the daemon: config, wiring, `python -m hixl.server.master.master`), `store`
(`ObjectStore`: the object index), `store_service` (`StoreCalls` and the gRPC Master
service), `store_rpc_server` (the store call endpoint), `metadata` / `etcd_metadata`
(where the store's metadata persists), `etcd_registry`, `leadership` (leader and
standbys), `master_http` (Mooncake's HTTP side).
"""
