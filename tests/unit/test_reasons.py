"""One home for every error reason: kvsvc.reasons.Reason, listed in the proto for other
languages, each raised with its own gRPC code, none written as a string literal in kvsvc, and
the three ways a call ends without an answer told apart by type, not by reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from kvsvc.client.errors import error_from_status
from kvsvc.errors import Cancelled, Unavailable, Unimplemented, Unreachable
from kvsvc.reasons import RETIRED, Reason
from kvsvc.v1 import kv_transfer_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO = (ROOT / "protos" / "kvsvc" / "v1" / "kv_transfer.proto").read_text()
SOURCES = sorted(p for p in (ROOT / "kvsvc").rglob("*.py") if "v1" not in p.parts and p.name != "reasons.py")

# The code each error class answers with, written here rather than read from the classes.
CLASS_CODES = {
    "InvalidArgument": "INVALID_ARGUMENT", "FailedPrecondition": "FAILED_PRECONDITION", "NotFound": "NOT_FOUND",
    "PermissionDenied": "PERMISSION_DENIED", "Unavailable": "UNAVAILABLE", "DeadlineExceeded": "DEADLINE_EXCEEDED",
    "Internal": "INTERNAL", "KvsvcError": "INTERNAL",
}
# Helpers that build an error from a reason: (argument position, keyword, code).
HELPERS = {"bad_field": (2, "reason", "INVALID_ARGUMENT"), "violation": (0, None, "FAILED_PRECONDITION")}


def proto_reasons() -> dict[str, list[str]]:
    """ERROR_REASON_<name> -> the codes its comment names in brackets, from the .proto text."""
    body = PROTO[PROTO.index("enum ErrorReason {"):]
    body = body[:body.index("\n}")]
    out: dict[str, list[str]] = {}
    comment: list[str] = []
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("//"):
            comment.append(line[2:].strip())
            continue
        m = re.fullmatch(r"ERROR_REASON_(\w+) = \d+;", line)
        assert m, line
        codes = re.findall(r"\[([A-Z_, ]+)\]$", " ".join(comment))
        out[m.group(1)] = codes[0].split(", ") if codes else []
        comment = []
    return out


def test_the_proto_lists_every_reason_with_its_codes():
    listed = proto_reasons()
    assert listed.pop("UNSPECIFIED") == []
    assert sorted(listed) == sorted(r.value for r in Reason)
    assert {r.value: [c.value for c in r.codes] for r in Reason} == listed
    # and the generated module agrees with the text (make proto was run)
    assert {n.removeprefix("ERROR_REASON_") for n in pb.ErrorReason.keys()} - {"UNSPECIFIED"} == set(listed)


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _reason_arg(node: ast.Call, name: str) -> ast.expr | None:
    if name in CLASS_CODES:
        return node.args[0] if node.args else None
    if name in HELPERS:
        pos, kw, _ = HELPERS[name]
        if len(node.args) > pos:
            return node.args[pos]
        return next((k.value for k in node.keywords if kw and k.arg == kw), None)
    return None


def raise_sites() -> list[tuple[str, str, str]]:
    """(where, reason, code) of every error kvsvc builds from a Reason member."""
    out = []
    for path in SOURCES:
        for node, name in _calls(ast.parse(path.read_text())):
            arg = _reason_arg(node, name)
            if not (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "Reason"):
                continue
            code = HELPERS[name][2] if name in HELPERS else CLASS_CODES[name]
            code = next((ast.unparse(k.value).rsplit(".", 1)[-1] for k in node.keywords if k.arg == "code"), code)
            if name == "KvsvcError" and len(node.args) > 2 and "ErrorCode." in ast.unparse(node.args[2]):
                code = ast.unparse(node.args[2]).rsplit(".", 1)[-1]
            out.append((f"{path.relative_to(ROOT)}:{node.lineno}", arg.attr, code))
    return out


def test_every_error_is_raised_with_its_reasons_code():
    sites = raise_sites()
    assert len(sites) > 120, len(sites)
    wrong = [(where, reason, code) for where, reason, code in sites
             if code not in [c.value for c in Reason[reason].codes]]
    assert not wrong, wrong


def test_every_reason_is_used_and_no_reason_is_a_string_literal():
    names = {r.value for r in Reason}
    used: set[str] = set()
    literals = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Reason":
                used.add(node.attr)
            if isinstance(node, ast.Constant) and node.value in names:
                literals.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not literals, literals
    assert sorted(names - used - RETIRED) == []
    assert sorted(used & RETIRED) == []  # a retired reason is not raised again


def test_no_reason_is_compared_with_a_string():
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides):
                continue
            consts = [c for s in sides for c in ([s] if not isinstance(s, (ast.Tuple, ast.List, ast.Set)) else s.elts)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            if consts:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def test_the_checkers_would_catch_what_they_look_for():
    assert next((r, c) for _, r, c in raise_sites() if r == "LEASE_EXPIRED") == ("LEASE_EXPIRED", "FAILED_PRECONDITION")
    tree = ast.parse('raise InvalidArgument(Reason.LEASE_EXPIRED, "x")\nif e.reason == "SOCKET_FULL": pass')
    (call, name), = [(n, m) for n, m in _calls(tree) if m]
    assert CLASS_CODES[name] not in [c.value for c in Reason[_reason_arg(call, name).attr].codes]
    assert any(isinstance(n, ast.Compare) and isinstance(n.comparators[0], ast.Constant) for n in ast.walk(tree))


def _status(code: int, reason: str | None) -> status_pb2.Status:
    details = []
    if reason is not None:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvsvc"))
        details.append(info)
    return status_pb2.Status(code=code, message="m", details=details)


@pytest.mark.parametrize(("code", "reason", "kind", "expected"), [
    (code_pb2.UNAVAILABLE, None, Unreachable, "UNAVAILABLE"),  # the channel's own: nothing answered
    (code_pb2.UNAVAILABLE, "UNAVAILABLE", Unreachable, "UNAVAILABLE"),  # a server relaying it
    (code_pb2.CANCELLED, None, Cancelled, "CANCELLED"),
    (code_pb2.UNIMPLEMENTED, None, Unimplemented, "UNIMPLEMENTED"),
])
def test_a_call_with_no_answer_is_typed(code, reason, kind, expected):
    e = error_from_status(_status(code, reason))
    assert isinstance(e, kind) and e.reason == expected, e


@pytest.mark.parametrize(("code", "reason"), [
    (code_pb2.UNAVAILABLE, "PEER_UNAVAILABLE"),  # a server's answer: not grounds for a retry
    (code_pb2.UNAVAILABLE, "SHUTTING_DOWN"),
    (code_pb2.CANCELLED, "TRANSFER_CANCELLED"),
    (code_pb2.RESOURCE_EXHAUSTED, "SOCKET_FULL"),
])
def test_a_servers_answer_is_not_a_call_with_no_answer(code, reason):
    e = error_from_status(_status(code, reason))
    assert e.reason == reason and not isinstance(e, (Unreachable, Cancelled, Unimplemented)), e
    assert isinstance(e, Unavailable) == (code == code_pb2.UNAVAILABLE)
