"""mask_url: no credential of a Redis URL ever reaches a log or the terminal."""

from __future__ import annotations

import pytest

from batching.resp import Address
from batching.urls import mask_url


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://default:S3cret@10.0.0.5:6379/0", "redis://default:**@10.0.0.5:6379/0"),
    ("redis://:S3cret@h/0", "redis://:**@h/0"),
    ("redis://S3cret@h:6379", "redis://**@h:6379"),
    ("rediss://app:S3cret@h:6380/1?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
     "rediss://app:**@h:6380/1?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"),
    ("redis+sentinel://:S3cret@h1:26379,h2:26379/mymaster/0",
     "redis+sentinel://:**@h1:26379,h2:26379/mymaster/0"),
    ("sentinel://:S3cret@h1:26379;sentinel://:S3cret@h2:26379",
     "sentinel://:**@h1:26379;sentinel://:**@h2:26379"),
    ("unix:///run/redis.sock?db=2&password=S3cret", "unix:///run/redis.sock?db=2&password=**"),
    ("unix://app:S3cret@/run/redis.sock?db=2", "unix://app:**@/run/redis.sock?db=2"),
    ("redis://h/0?sentinel_password=S3cret#x", "redis://h/0?sentinel_password=**#x"),
    ("redis://app:S3/c?r#et@h:6379/0", "redis://app:**@h:6379/0"),
])
def test_credentials_are_masked(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "S3" not in mask_url(url)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "unix:///run/redis.sock?db=2", "redis://app:@h/0",
    "rediss://h:6380/0?ssl_cert_reqs=none", "not a url",
])
def test_urls_without_secrets_are_unchanged(url: str) -> None:
    assert mask_url(url) == url


def test_redis_address_errors_and_repr_hide_the_password() -> None:
    with pytest.raises(ValueError, match=r"http://app:\*\*@h") as raised:
        Address.from_url("http://app:S3cret@h:6379/0")
    assert "S3cret" not in str(raised.value)
    assert "S3cret" not in repr(Address.from_url("redis://app:S3cret@h:6379/0"))
