"""The transport both sides share: addresses, the token header and the attestation path."""

from __future__ import annotations

import pytest

from deadweight.proto.transport import (
    attest_path,
    bearer_matches,
    bearer_metadata,
    grpc_target,
    unix_socket_path,
)


@pytest.mark.parametrize(
    ("address", "target", "path"),
    [("/run/d.sock", "unix:///run/d.sock", "/run/d.sock"),
     ("unix:///run/d.sock", "unix:///run/d.sock", "/run/d.sock"),
     ("unix:/run/d.sock", "unix:/run/d.sock", "/run/d.sock"),
     ("127.0.0.1:5000", "127.0.0.1:5000", None),
     ("dns:///sidecar:5000", "dns:///sidecar:5000", None)],
)
def test_an_address_becomes_one_target_and_socket_path(
    address: str, target: str, path: str | None
) -> None:
    assert grpc_target(address) == target
    assert unix_socket_path(grpc_target(address)) == path


def test_the_attestation_socket_sits_next_to_the_grpc_socket() -> None:
    assert str(attest_path("/run/d.sock")) == "/run/d.sock.attest"


def test_the_token_the_client_sends_is_the_one_the_sidecar_accepts() -> None:
    assert bearer_matches(bearer_metadata("s3cret"), "s3cret")
    for offered in (bearer_metadata("s3cre"), bearer_metadata("s3cretx"), bearer_metadata(None),
                    bearer_metadata(""), (("authorization", "s3cret"),), None):
        assert not bearer_matches(offered, "s3cret"), offered
