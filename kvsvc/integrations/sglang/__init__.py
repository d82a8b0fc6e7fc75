"""kvsvc as SGLang's disaggregation transfer backend: `--disaggregation-transfer-backend kvsvc`.

An SGLang plugin (entry point "kvsvc" in the group `sglang.srt.plugins`, declared by
kvsvc's package): SGLang calls register() early in each of its processes, before it parses
arguments. It adds "kvsvc" to the backends SGLang knows and answers SGLang's get_kv_class
for it with the classes in kvsvc.integrations.sglang.conn; no SGLang file is edited.
Importing this package needs no SGLang; register() does.
"""

from __future__ import annotations

from typing import Any

BACKEND = "kvsvc"
_registered = False


def _add_backend_member(enum_cls: Any) -> Any:
    """SGLang names its backends in an Enum that TransferBackend(value) must resolve."""
    if BACKEND in enum_cls._value2member_map_:
        return enum_cls(BACKEND)
    member = object.__new__(enum_cls)
    member._name_, member._value_ = BACKEND.upper(), BACKEND
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, member._name_, member)
    enum_cls._member_map_[member._name_] = member
    enum_cls._value2member_map_[BACKEND] = member
    enum_cls._member_names_.append(member._name_)
    return member


def _kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or class_type.value == "kvargs":
        return original(transfer_backend, class_type)
    from kvsvc.integrations.sglang import conn

    return {"manager": conn.KvsvcKVManager, "sender": conn.KvsvcKVSender, "receiver": conn.KvsvcKVReceiver,
            "bootstrap_server": conn.KvsvcKVBootstrapServer}[class_type.value]


def register() -> None:
    """The plugin's entry point (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _add_backend_member(TransferBackend)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _kv_class, HookType.AROUND)
    _registered = True
