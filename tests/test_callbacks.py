"""The callback URL policy (batching.callbacks), with resolution injected."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from batching.callbacks import AllowList, CallbackRefused, Target, check_callback
from workers.job_tasks import deliver, send_callback


def resolver(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"no such host {host}")
        return table[host]
    return resolve


DNS = resolver({"hooks.example.com": ["93.184.216.34", "2606:2800:220:1::1"],
                "inside.example.com": ["10.1.2.3"],
                "mixed.example.com": ["93.184.216.34", "127.0.0.1"],
                "mapped.example.com": ["::ffff:169.254.169.254"]})
ALLOWED = AllowList.parse("hooks.example.com, Inside.Example.com., mixed.example.com,"
                          "mapped.example.com, 93.184.216.35, 10.9.0.0/16, 127.0.0.2")


def test_a_listed_public_host_is_allowed_with_every_address_it_resolves_to() -> None:
    target = check_callback("https://hooks.example.com/jobs?x=1", ALLOWED, DNS)
    assert target == Target("https", "hooks.example.com", 443,
                            ("93.184.216.34", "2606:2800:220:1::1"))
    assert check_callback("http://HOOKS.example.com.:8080/", ALLOWED, DNS).port == 8080


@pytest.mark.parametrize(("url", "words"), [
    ("ftp://hooks.example.com/", "http or https"),
    ("file:///etc/passwd", "http or https"),
    ("http:///path", "names no host"),
    ("http://hooks.example.com:99999/", "not a URL"),
    ("https://other.example.com/", "'other.example.com' is not in CONVEYOR_CALLBACK_HOSTS"),
    ("http://93.184.216.34/", "93.184.216.34 is not in CONVEYOR_CALLBACK_HOSTS"),
    ("http://inside.example.com/", "resolves to 10.1.2.3, a non-public address"),
    ("http://mixed.example.com/", "resolves to 127.0.0.1"),
    ("http://mapped.example.com/", "169.254.169.254"),
    ("http://[::1]/", "::1 is not in CONVEYOR_CALLBACK_HOSTS"),
])
def test_refusals_say_precisely_why(url: str, words: str) -> None:
    with pytest.raises(CallbackRefused) as refused:
        check_callback(url, ALLOWED, DNS)
    assert words in refused.value.message


def test_listed_addresses_and_networks_are_allowed_even_when_private() -> None:
    assert check_callback("http://127.0.0.2:9000/cb", ALLOWED, DNS).addresses == ("127.0.0.2",)
    assert check_callback("http://10.9.4.4/", ALLOWED, DNS).addresses == ("10.9.4.4",)
    assert check_callback("http://93.184.216.35/", ALLOWED, DNS).addresses == ("93.184.216.35",)
    only_name = AllowList.parse("inside.example.com,10.1.2.3")
    assert check_callback("http://inside.example.com/", only_name, DNS).addresses == (
        "10.1.2.3",)


def test_no_hosts_listed_refuses_every_callback() -> None:
    with pytest.raises(CallbackRefused, match="turned off"):
        check_callback("https://hooks.example.com/", AllowList.parse(""), DNS)


def test_a_name_that_rebinds_to_a_private_address_is_refused_on_the_next_check() -> None:
    answers = [["93.184.216.34"], ["192.168.1.1"]]

    def rebinding(host: str, port: int) -> list[str]:
        return answers.pop(0)

    allowed = AllowList.parse("hooks.example.com")
    assert check_callback("http://hooks.example.com/", allowed, rebinding).addresses == (
        "93.184.216.34",)
    with pytest.raises(CallbackRefused, match=r"192\.168\.1\.1"):
        check_callback("http://hooks.example.com/", allowed, rebinding)


def test_a_name_that_does_not_resolve_raises_os_error() -> None:
    with pytest.raises(OSError):
        check_callback("http://gone.example.com/", AllowList.parse("gone.example.com"), DNS)


@pytest.mark.parametrize("address", ["0.0.0.0", "100.64.0.1", "224.0.0.1", "240.0.0.1",
                                     "fe80::1", "fc00::1", "ff02::1", "::"])
def test_special_ranges_are_refused(address: str) -> None:
    dns = resolver({"h.example.com": [address]})
    with pytest.raises(CallbackRefused, match="non-public"):
        check_callback("http://h.example.com/", AllowList.parse("h.example.com"), dns)


# --- Delivery by the job worker (workers.job_tasks) ---------------------------------------------

class _Hook(BaseHTTPRequestHandler):
    """Answers 302 to /redirect, 200 otherwise; records (path, Host header)."""

    seen: ClassVar[list[tuple[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, self.headers["Host"]))
        self.send_response(302 if self.path == "/redirect" else 200)
        self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.seen.clear()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_the_worker_posts_to_the_checked_address_under_the_urls_host_name(hook: int) -> None:
    dns = resolver({"hooks.test": ["127.0.0.1"]})
    allowed = AllowList.parse("hooks.test,127.0.0.1")
    response = deliver(f"http://hooks.test:{hook}/done?x=1", {"id": "j"}, allowed, dns)
    assert response.status_code == 200
    assert _Hook.seen == [("/done?x=1", f"hooks.test:{hook}")]
    redirected = deliver(f"http://hooks.test:{hook}/redirect", {"id": "j"}, allowed, dns)
    assert redirected.status_code == 302 and len(_Hook.seen) == 2  # not followed


def test_the_worker_tries_the_next_checked_address_when_one_refuses(hook: int) -> None:
    dns = resolver({"hooks.test": ["127.0.0.3", "127.0.0.1"]})  # the hook listens on .1 only
    allowed = AllowList.parse("hooks.test,127.0.0.0/29")
    assert deliver(f"http://hooks.test:{hook}/done", {"id": "j"}, allowed, dns).status_code == 200
    assert _Hook.seen == [("/done", f"hooks.test:{hook}")]


def test_the_worker_refuses_a_name_now_resolving_to_an_unlisted_private_address(
        hook: int) -> None:
    dns = resolver({"hooks.test": ["127.0.0.1"]})
    with pytest.raises(CallbackRefused):
        deliver(f"http://hooks.test:{hook}/done", {"id": "j"}, AllowList.parse("hooks.test"), dns)
    assert _Hook.seen == []


def test_a_refused_callback_task_gives_up_at_once(hook: int) -> None:
    assert send_callback(f"http://127.0.0.1:{hook}/done", {"id": "j"}) == 0  # no hosts listed
    assert _Hook.seen == []
