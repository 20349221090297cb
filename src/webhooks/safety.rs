//! Where a webhook may go: public addresses only, unless an operator allows a network
//! (`webhooks.allowed_networks`). Checked when an endpoint is registered (every address its
//! name resolves to) and again at every connect: an IP literal before sending, a name by the
//! HTTP client's resolver ([`SafeResolver`]), which hands the client only allowed addresses, so a
//! name that resolves elsewhere since registration (DNS rebinding) cannot reach an inner host.
//! Redirects are never followed (the client's policy): a 3xx is a failed attempt.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// A CIDR network an operator allows although it is private.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    address: IpAddr,
    prefix: u8,
}

impl Network {
    pub fn parse(text: &str) -> anyhow::Result<Network> {
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let address: IpAddr = address
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("not an IP address: {address:?}"))?;
        let bits = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) => prefix
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|prefix| *prefix <= bits)
                .ok_or_else(|| anyhow::anyhow!("not a prefix length of 0 to {bits}: {prefix:?}"))?,
            None => bits,
        };
        Ok(Network { address, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.address, canonical(ip)) {
            (IpAddr::V4(network), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(network) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(network), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(network) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// An IPv4 address written as IPv6 is judged as the IPv4 address it reaches: mapped
/// (`::ffff:a.b.c.d`), translated (SIIT, `::ffff:0:a.b.c.d`), compatible (`::a.b.c.d`) and NAT64's
/// well-known prefix (`64:ff9b::a.b.c.d`). The forms that carry one inside other bits (6to4,
/// Teredo) are judged by [`embedded_v4`] as well.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return IpAddr::V4(v4);
            }
            let segments = v6.segments();
            let last_two = || {
                let [a, b] = segments[6].to_be_bytes();
                let [c, d] = segments[7].to_be_bytes();
                Ipv4Addr::new(a, b, c, d)
            };
            if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
                || segments[..6] == [0, 0, 0, 0, 0xffff, 0]
            {
                return IpAddr::V4(last_two());
            }
            // IPv4-compatible (deprecated, still routed by some stacks); `::` and `::1` stay IPv6.
            if segments[..6] == [0; 6] && u32::from(last_two()) > 1 {
                return IpAddr::V4(last_two());
            }
            IpAddr::V6(v6)
        }
        v4 => v4,
    }
}

/// The IPv4 addresses an IPv6 address carries in other bits: 6to4 (`2002:AABB:CCDD::/48`) and
/// Teredo (`2001::/32`: its server, and its client stored inverted in the last 32 bits).
fn embedded_v4(v6: Ipv6Addr) -> Vec<Ipv4Addr> {
    let segments = v6.segments();
    let of = |high: u16, low: u16| Ipv4Addr::from((u32::from(high) << 16) | u32::from(low));
    match segments[..2] {
        [0x2002, _] => vec![of(segments[1], segments[2])],
        [0x2001, 0] => vec![
            of(segments[2], segments[3]),
            Ipv4Addr::from(!((u32::from(segments[6]) << 16) | u32::from(segments[7]))),
        ],
        _ => Vec::new(),
    }
}

/// Why an IPv4 address is not a public one, if it is not (IANA's special-purpose registry: what
/// is not globally reachable).
fn v4_forbidden_because(v4: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = v4.octets();
    if v4.is_loopback() {
        Some("loopback")
    } else if v4.is_unspecified() || a == 0 {
        Some("unspecified")
    } else if v4.is_private() {
        Some("private")
    } else if v4.is_link_local() {
        // 169.254.169.254 is the cloud metadata service.
        Some("link-local (cloud metadata)")
    } else if a == 100 && (64..128).contains(&b) {
        Some("shared address space (CGNAT)")
    } else if v4.is_multicast() || v4.is_broadcast() || a >= 240 {
        Some("multicast, broadcast or reserved")
    } else if a == 192 && b == 0 && c == 0 {
        Some("IETF protocol assignments")
    } else if (a, b, c) == (192, 0, 2) || (a, b, c) == (198, 51, 100) || (a, b, c) == (203, 0, 113)
    {
        Some("documentation (TEST-NET)")
    } else if a == 198 && (b == 18 || b == 19) {
        Some("benchmarking")
    } else if (a, b, c) == (192, 88, 99) {
        Some("6to4 relay anycast")
    } else {
        None
    }
}

/// The parts of 2001::/23 IANA's registry marks globally reachable: 2001:1::1 and 2001:1::2
/// (anycast), AMT (2001:3::/32), AS112-v6 (2001:4:112::/48), ORCHIDv2 (2001:20::/28) and Drone
/// Remote ID (2001:30::/28).
fn ietf_reachable(v6: Ipv6Addr) -> bool {
    let segments = v6.segments();
    let anycast = segments[1] == 1 && segments[2..7] == [0; 5] && matches!(segments[7], 1 | 2);
    anycast
        || segments[1] == 3
        || segments[1..3] == [4, 0x112]
        || segments[1] & 0xfff0 == 0x20
        || segments[1] & 0xfff0 == 0x30
}

/// Why an address is not a public one, if it is not.
pub fn forbidden_because(ip: IpAddr) -> Option<&'static str> {
    match canonical(ip) {
        IpAddr::V4(v4) => v4_forbidden_because(v4),
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let first = segments[0];
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if first & 0xfe00 == 0xfc00 {
                // Unique local, also AWS's metadata fd00:ec2::254.
                Some("unique local")
            } else if first & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if first & 0xffc0 == 0xfec0 {
                Some("site-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if segments[..2] == [0x2001, 0x0db8] || (first == 0x3fff && segments[1] < 0x1000)
            {
                Some("documentation")
            } else if segments[..4] == [0x100, 0, 0, 0] {
                Some("discard-only")
            } else if segments[..4] == [0x100, 0, 0, 1] {
                Some("dummy prefix")
            } else if first == 0x5f00 {
                Some("SRv6 segment identifiers")
            } else if first == 0x2001
                && segments[1] != 0
                && segments[1] < 0x200
                && !ietf_reachable(v6)
            {
                // 2001::/23 but Teredo (2001::/32, judged by the address it embeds): ORCHID,
                // benchmarking and the rest, save the few the registry calls reachable.
                Some("IETF protocol assignments")
            } else if segments[..3] == [0x64, 0xff9b, 1] {
                // Local-use NAT64 (64:ff9b:1::/48): where its IPv4 address sits depends on the
                // operator's prefix length, so what it reaches cannot be told.
                Some("local-use NAT64")
            } else {
                embedded_v4(v6).into_iter().find_map(v4_forbidden_because)
            }
        }
    }
}

/// This host's own addresses, on every interface, read again at most every ten seconds: a
/// receiver there reaches any service of ours that listens on all interfaces.
fn own_addresses() -> Arc<Vec<IpAddr>> {
    static OWN: std::sync::Mutex<Option<(std::time::Instant, Arc<Vec<IpAddr>>)>> =
        std::sync::Mutex::new(None);
    let mut own = OWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((read_at, addresses)) = own.as_ref()
        && read_at.elapsed() < std::time::Duration::from_secs(10)
    {
        return addresses.clone();
    }
    let addresses: Arc<Vec<IpAddr>> = Arc::new(
        if_addrs::get_if_addrs()
            .map(|interfaces| {
                interfaces
                    .into_iter()
                    .map(|interface| interface.ip())
                    .collect()
            })
            .unwrap_or_default(),
    );
    *own = Some((std::time::Instant::now(), addresses.clone()));
    addresses
}

/// The operator's allowed networks.
#[derive(Debug, Clone, Default)]
pub struct Allowed(Arc<Vec<Network>>);

impl Allowed {
    pub fn parse(networks: &[String]) -> anyhow::Result<Allowed> {
        Ok(Allowed(Arc::new(
            networks
                .iter()
                .map(|network| Network::parse(network))
                .collect::<anyhow::Result<Vec<_>>>()?,
        )))
    }

    /// Why `ip` may not be delivered to, if it may not.
    pub fn refuses(&self, ip: IpAddr) -> Option<&'static str> {
        self.refuses_among(ip, &own_addresses())
    }

    /// [`Allowed::refuses`] on a host whose own addresses are `own`.
    fn refuses_among(&self, ip: IpAddr, own: &[IpAddr]) -> Option<&'static str> {
        let reason = forbidden_because(ip).or_else(|| {
            own.iter()
                .any(|address| canonical(*address) == canonical(ip))
                .then_some("an address of this host")
        })?;
        if self.0.iter().any(|network| network.contains(ip)) {
            None
        } else {
            Some(reason)
        }
    }
}

/// Why a URL may not be an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsafeUrl {
    #[error("url: not an http(s) URL ({0})")]
    Malformed(String),
    #[error("url: credentials in a URL are not taken")]
    Credentials,
    #[error("url: {host} is {address} ({reason}), where webhooks never go")]
    Forbidden {
        host: String,
        address: IpAddr,
        reason: &'static str,
    },
    #[error("url: {0} does not resolve")]
    Unresolved(String),
}

/// Check `url` and every address its host resolves to now.
pub async fn check_url(url: &str, allowed: &Allowed) -> Result<reqwest::Url, UnsafeUrl> {
    let parsed =
        reqwest::Url::parse(url).map_err(|error| UnsafeUrl::Malformed(error.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(UnsafeUrl::Malformed(format!(
            "the scheme {} is not http or https",
            parsed.scheme()
        )));
    }
    if parsed.port() == Some(0) {
        return Err(UnsafeUrl::Malformed("port 0 is no port to call".into()));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(UnsafeUrl::Credentials);
    }
    let host = parsed
        .host_str()
        .ok_or_else(|| UnsafeUrl::Malformed("no host".into()))?
        .to_owned();
    let port = parsed.port_or_known_default().unwrap_or(443);
    let addresses: Vec<IpAddr> = match parsed.host() {
        Some(url::Host::Ipv4(v4)) => vec![IpAddr::V4(v4)],
        Some(url::Host::Ipv6(v6)) => vec![IpAddr::V6(v6)],
        _ => tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|_| UnsafeUrl::Unresolved(host.clone()))?
            .map(|socket| socket.ip())
            .collect(),
    };
    if addresses.is_empty() {
        return Err(UnsafeUrl::Unresolved(host));
    }
    for address in addresses {
        if let Some(reason) = allowed.refuses(address) {
            return Err(UnsafeUrl::Forbidden {
                host,
                address,
                reason,
            });
        }
    }
    Ok(parsed)
}

/// The webhook client's resolver: only allowed addresses reach the connector.
#[derive(Debug, Clone)]
pub struct SafeResolver {
    pub allowed: Allowed,
}

impl reqwest::dns::Resolve for SafeResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allowed = self.allowed.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let safe: Vec<SocketAddr> = found
                .into_iter()
                .filter(|socket| allowed.refuses(socket.ip()).is_none())
                .collect();
            if safe.is_empty() {
                let error: Box<dyn std::error::Error + Send + Sync> =
                    format!("{host} resolves only to addresses webhooks never go to").into();
                return Err(error);
            }
            let addresses: reqwest::dns::Addrs = Box::new(safe.into_iter());
            Ok(addresses)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> Option<&'static str> {
        Allowed::default().refuses(text.parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)))
    }

    #[test]
    fn inner_addresses_of_both_families_are_refused_and_public_ones_taken() {
        for inner in [
            "127.0.0.1",
            "127.8.9.10",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fd00:ec2::254",
            "fc00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            // IPv4 inside IPv6: compatible, translated (SIIT), 6to4, Teredo (client inverted),
            // local-use NAT64.
            "::127.0.0.1",
            "::ffff:0:7f00:1",
            "2002:7f00:1::1",
            "2002:a9fe:a9fe::",
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
            "2001:0:7f00:1::1",
            "64:ff9b:1::a00:1",
            // Not globally reachable (IANA's special-purpose registry).
            "192.0.2.10",
            "198.51.100.7",
            "203.0.113.9",
            "198.18.0.1",
            "198.19.255.254",
            "240.0.0.1",
            "192.88.99.1",
            "2001:db8::1",
            "3fff::1",
            "100::1",
            "100:0:0:1::7",
            "fec0::1",
            "2001:10::1",
            "2001:2::1",
            "2001:1::3",
            "2001:100::1",
            "5f00::1",
        ] {
            assert!(refused(inner).is_some(), "{inner} was taken");
        }
        for public in [
            "93.184.216.34",
            "8.8.8.8",
            "2606:4700:4700::1111",
            "2001:20::1",
            "2001:4:112::1",
            "2001:1::1",
            "2001:200::1",
            "172.32.0.1",
            "198.20.0.1",
            "2002:5db8:d822::1",
            "2001:0:4136:e378:8000:63bf:a247:d7dd",
        ] {
            assert_eq!(refused(public), None, "{public} was refused");
        }
    }

    #[test]
    fn an_address_of_this_host_is_refused_unless_allowed() {
        let own: Vec<IpAddr> = ["93.184.216.34", "2606:4700:4700::1111"]
            .iter()
            .filter_map(|text| text.parse().ok())
            .collect();
        let public = |text: &str| text.parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let none = Allowed::default();
        assert_eq!(
            none.refuses_among(public("93.184.216.34"), &own),
            Some("an address of this host")
        );
        assert_eq!(
            none.refuses_among(public("::ffff:93.184.216.34"), &own),
            Some("an address of this host")
        );
        assert_eq!(
            none.refuses_among(public("2606:4700:4700::1111"), &own),
            Some("an address of this host")
        );
        assert_eq!(none.refuses_among(public("8.8.8.8"), &own), None);
        let allowed = Allowed::parse(&["93.184.216.0/24".into()]).unwrap_or_default();
        assert_eq!(allowed.refuses_among(public("93.184.216.34"), &own), None);
    }

    #[test]
    fn an_operator_may_allow_a_network() {
        let allowed =
            Allowed::parse(&["127.0.0.0/8".into(), "fd00::/8".into()]).unwrap_or_default();
        assert_eq!(
            allowed.refuses(
                "127.0.0.1"
                    .parse()
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
            ),
            None
        );
        assert!(
            allowed
                .refuses(
                    "10.0.0.1"
                        .parse()
                        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
                )
                .is_some()
        );
        assert!(Network::parse("10.0.0.0/33").is_err());
        assert!(Network::parse("not an address").is_err());
    }

    #[tokio::test]
    async fn urls_are_refused_naming_the_address_and_why() {
        let allowed = Allowed::default();
        for url in [
            "http://127.0.0.1:8080/hook",
            "http://[::1]/hook",
            "http://169.254.169.254/latest/meta-data",
            "http://localhost:9/hook",
            "http://[::ffff:10.0.0.1]/hook",
        ] {
            let refused = check_url(url, &allowed).await;
            assert!(
                matches!(refused, Err(UnsafeUrl::Forbidden { .. })),
                "{url}: {refused:?}"
            );
        }
        assert!(matches!(
            check_url("ftp://example.com/", &allowed).await,
            Err(UnsafeUrl::Malformed(_))
        ));
        assert_eq!(
            check_url("https://user:pass@example.com/", &allowed).await,
            Err(UnsafeUrl::Credentials)
        );
        assert!(matches!(
            check_url("http://93.184.216.34:0/hook", &allowed).await,
            Err(UnsafeUrl::Malformed(_))
        ));
        // The scheme and host are case-insensitive: the URL comes back in its usual form.
        assert_eq!(
            check_url("HTTP://93.184.216.34/Hook", &allowed)
                .await
                .map(|url| url.to_string()),
            Ok("http://93.184.216.34/Hook".to_owned())
        );
    }
}
