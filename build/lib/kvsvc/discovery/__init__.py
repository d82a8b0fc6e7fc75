"""Discovery: kvsvc servers registered in etcd, resolved and watched by engine id."""

from kvsvc.discovery.etcd import EtcdClient
from kvsvc.discovery.registry import (
    Registration,
    ServerChange,
    ServerRecord,
    list_engines,
    resolve,
    watch_servers,
)

__all__ = ["EtcdClient", "Registration", "ServerChange", "ServerRecord", "list_engines", "resolve", "watch_servers"]
