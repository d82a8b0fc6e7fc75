"""Python client of kvsvc.v1: async and sync, errors as KvsvcError. Needs only grpcio + protobuf."""

from kvsvc.client.client import AsyncClient, Client, ClientOptions
from kvsvc.client.errors import error_from_rpc
from kvsvc.client.params import params_from_json, params_to_json

__all__ = ["AsyncClient", "Client", "ClientOptions", "error_from_rpc", "params_from_json", "params_to_json"]
