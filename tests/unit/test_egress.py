"""The webhook address policy (shared/egress.py) over a table of URLs: every form that spells an
internal address, public addresses, and LLMQ_WEBHOOK_ALLOW's host names and CIDRs. Lookups that
decide are given as the addresses a name "resolved" to; the last tests resolve for real
(``localhost`` through /etc/hosts)."""

from __future__ import annotations

import ipaddress

import pytest

from shared.egress import Policy, Refused, check_url, destination, pin

PUBLIC = "93.184.215.14"


def judge(allow: str, url: str, resolved: tuple[str, ...] = ()) -> str:
    """"ok", or the refusal's message; ``resolved`` stands in for the name's lookup."""
    rules = Policy.parse(allow)
    try:
        _, host, _ = destination(url)
        if not rules.screen(host):
            rules.check_addresses(host, [ipaddress.ip_address(a) for a in resolved])
    except Refused as exc:
        return exc.message
    return "ok"


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1/", "loopback"),
    ("http://127.0.0.1:8080/hook?x=1", "loopback"),
    ("http://127.9.9.9/", "loopback"),
    ("http://[::1]/", "loopback"),
    # IPv6 spellings of an IPv4 address: mapped (dotted and hex), NAT64, 6to4, IPv4-compatible
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://[::ffff:7f00:1]/", "loopback"),
    ("http://[64:ff9b::7f00:1]/", "loopback"),
    ("http://[2002:7f00:1::]/", "loopback"),
    ("http://[::ffff:10.0.0.1]/", "private"),
    ("http://[::127.0.0.1]/", "reserved"),
    # numeric forms the C resolver reads as 127.0.0.1: decimal, hex, octal, short, mixed
    ("http://2130706433/", "loopback"),
    ("http://0x7f000001/", "loopback"),
    ("http://017700000001/", "loopback"),
    ("http://0x7f.1/", "loopback"),
    ("http://127.1/", "loopback"),
    ("http://0x7f.0x0.0x0.0x1/", "loopback"),
    ("http://0177.0.0.1/", "not a valid URL"),  # httpx refuses a leading-zero dotted quad outright
    # trailing dots, case, userinfo and fragment tricks: the host is the one httpx connects to
    ("http://127.0.0.1./", "loopback"),
    ("http://localhost./", "local or cloud-metadata name"),
    ("http://LOCALHOST:9/", "local or cloud-metadata name"),
    ("http://public.example@127.0.0.1/", "loopback"),
    ("http://public.example:secret@127.0.0.1:80/", "loopback"),
    ("http://127.0.0.1#@public.example/", "loopback"),
    ("http://%31%32%37.0.0.1/", "not a host name"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://10.1.2.3/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://[fc00::1]/", "private"),
    ("http://[fd12:3456::1]/", "private"),
    ("http://100.64.0.1/", "shared (CGNAT)"),
    ("http://169.254.1.1/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://224.0.0.1/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://240.0.0.1/", "private"),  # Python files 240/4 under is_private: refused either way
    ("http://[fec0::1]/", "site-local"),
    ("http://192.0.0.8/", "IETF protocol"),
    # cloud metadata: AWS/GCP/Azure/OpenStack, AWS over IPv6, Alibaba, Azure's wireserver, by name
    ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
    ("http://[fd00:ec2::254]/", "cloud metadata"),
    ("http://100.100.100.200/", "cloud metadata"),
    ("http://168.63.129.16/", "cloud metadata"),
    ("http://[::ffff:169.254.169.254]/", "cloud metadata"),
    ("http://metadata.google.internal/computeMetadata/v1/", "local or cloud-metadata name"),
    ("http://metadata/", "local or cloud-metadata name"),
    ("http://hooks.localhost/", "local or cloud-metadata name"),
])
def test_internal_destinations_are_refused_by_default(url, why):
    assert why in judge("", url)


@pytest.mark.parametrize(("url", "resolved", "why"), [
    ("https://hooks.example.com/", (PUBLIC, "10.0.0.5"), "hooks.example.com resolves to a private address"),
    ("https://hooks.example.com/", ("::ffff:127.0.0.1",), "resolves to a loopback address"),
    ("https://hooks.example.com./", ("169.254.169.254",), "resolves to a cloud metadata address"),
])
def test_a_name_is_refused_when_any_address_it_resolves_to_is(url, resolved, why):
    message = judge("", url, resolved)
    assert why in message
    assert all(a not in message for a in resolved)  # the client is not told the internal address


@pytest.mark.parametrize(("url", "resolved"), [
    (f"http://{PUBLIC}/hook", ()),
    ("https://8.8.8.8:8443/x?y=1", ()),
    ("http://[2606:4700::1111]/", ()),
    ("http://[::ffff:8.8.8.8]/", ()),
    ("http://[64:ff9b::808:808]/", ()),  # DNS64: a public IPv4 address behind NAT64
    (f"http://user:pw@{PUBLIC}/", ()),
    ("https://hooks.example.com/", (PUBLIC, "2606:2800:220:1::")),
    ("https://Hooks.Example.COM./x", (PUBLIC,)),
])
def test_public_destinations_are_allowed_by_default(url, resolved):
    assert judge("", url, resolved) == "ok"


@pytest.mark.parametrize(("allow", "url", "resolved", "expected"), [
    # a CIDR: every form of a listed address, nothing else (public included)
    ("127.0.0.1/32", "http://127.0.0.1:9/", (), "ok"),
    ("127.0.0.1/32", "http://0x7f.1/", (), "ok"),
    ("127.0.0.1/32", "http://[::ffff:127.0.0.1]/", (), "ok"),
    ("127.0.0.1/32", "http://127.0.0.2/", (), "outside LLMQ_WEBHOOK_ALLOW"),
    ("127.0.0.1/32", f"http://{PUBLIC}/", (), "outside LLMQ_WEBHOOK_ALLOW"),
    ("127.0.0.1/32", "http://localhost/", ("127.0.0.1",), "ok"),
    ("127.0.0.1/32", "http://localhost/", ("127.0.0.1", "::1"), "localhost resolves to an address outside"),
    ("127.0.0.1", "http://127.0.0.1/", (), "ok"),  # a bare address is its /32
    ("10.0.0.0/8, hooks.example.com", "http://10.1.2.3/", (), "ok"),
    ("10.0.0.0/8, hooks.example.com", "http://other.example.com/", ("10.0.0.9",), "ok"),
    ("10.0.0.0/8, hooks.example.com", "http://other.example.com/", ("10.0.0.9", PUBLIC), "outside"),
    ("10.0.0.1/8", "http://10.200.0.1/", (), "ok"),  # host bits in a CIDR are ignored
    ("fd00::/8", "http://[fd00::1]/", (), "ok"),
    ("169.254.169.254/32", "http://169.254.169.254/", (), "ok"),  # an operator may list anything
    # a host name: the URL's host exactly, case-insensitively, trailing dot ignored; its
    # addresses are not checked (the operator vouched for the name, private or not)
    ("hooks.internal", "http://HOOKS.internal./x", ("10.0.0.1",), "ok"),
    ("hooks.internal", "http://evil.example@hooks.internal/", (), "ok"),
    ("hooks.internal", "http://hooks.internal@evil.example/", (), "evil.example is not in LLMQ_WEBHOOK_ALLOW"),
    ("hooks.internal", "http://x.hooks.internal/", (), "not in LLMQ_WEBHOOK_ALLOW"),
    ("hooks.internal", "http://hooks.internal.evil.example/", (), "not in LLMQ_WEBHOOK_ALLOW"),
    ("hooks.internal", "http://10.0.0.1/", (), "outside LLMQ_WEBHOOK_ALLOW"),
    ("hooks.internal", f"http://{PUBLIC}/", (), "outside LLMQ_WEBHOOK_ALLOW"),
    ("localhost", "http://localhost:8080/", (), "ok"),
    ("localhost", "http://127.0.0.1:8080/", (), "outside LLMQ_WEBHOOK_ALLOW"),
])
def test_an_allow_list_allows_exactly_what_it_lists(allow, url, resolved, expected):
    outcome = judge(allow, url, resolved)
    assert outcome == "ok" if expected == "ok" else expected in outcome, outcome


@pytest.mark.parametrize("allow", ["10.0.0.0/33", "*.example.com", "hooks example.com", "http://x.example/"])
def test_a_bad_allow_entry_is_named(allow):
    with pytest.raises(ValueError, match="LLMQ_WEBHOOK_ALLOW"):
        Policy.parse(f"127.0.0.1/32,{allow}")


def test_an_empty_allow_list_means_public_only():
    assert not Policy.parse(" , ").restricted and Policy.parse("") == Policy()


# --- real lookups (localhost through /etc/hosts; .invalid never resolves, RFC 6761) ---------------

async def test_the_submit_check_resolves_names():
    with pytest.raises(Refused, match="local or cloud-metadata name"):
        await check_url(Policy(), "http://localhost:1/")
    with pytest.raises(Refused, match="localhost resolves to an address outside") as refused:
        await check_url(Policy.parse("10.0.0.0/8"), "http://localhost:1/")
    assert refused.value.address is not None and refused.value.address.is_loopback
    await check_url(Policy.parse("127.0.0.0/8,::1/128"), "http://localhost:1/")  # passes: by its addresses
    await check_url(Policy(), "http://hook.example.invalid/")  # does not resolve now: delivery decides


async def test_a_delivery_is_pinned_to_the_address_it_checked():
    target = await pin(Policy.parse("localhost"), "https://user@localhost:8443/p?q=1", timeout_s=5)
    assert target.address.is_loopback and target.url.host == str(target.address)
    assert (target.url.port, target.url.raw_path, target.url.username) == (8443, b"/p?q=1", "user")
    assert target.headers == {"Host": "localhost:8443", "Connection": "close"}
    assert target.extensions == {"sni_hostname": "localhost"}  # the certificate is checked for the name
    literal = await pin(Policy.parse("127.0.0.1/32"), "https://0x7f.1/", timeout_s=5)
    assert str(literal.url) == "https://127.0.0.1/" and literal.extensions == {}
    with pytest.raises(Refused, match="localhost resolves to an address outside"):
        await pin(Policy.parse("192.0.2.0/24"), "http://localhost:8443/", timeout_s=5)
    with pytest.raises(OSError):
        await pin(Policy(), "http://hook.example.invalid/", timeout_s=5)
