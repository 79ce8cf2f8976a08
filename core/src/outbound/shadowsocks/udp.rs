//! Shadowsocks UDP: one datagram per packet, each self-contained (SIP004),
//! or a session with packet ids whose server side is checked for replays
//! (SIP022). Encoders and decoders over byte slices: every length read from
//! the network is checked.

use std::ops::Range;

use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use kerntun_proto::framing::shadowsocks::{AeadError, TYPE_CLIENT, TYPE_SERVER, check_time};
use shadowsocks_crypto::utils::random_iv_or_salt;
use shadowsocks_crypto::v1::Cipher as V1Cipher;
use shadowsocks_crypto::v2::udp::UdpCipher;

use super::{Key, Method, ShadowsocksError, random_padding_len, unix_now};
use crate::outbound::addr::Address;

/// SIP022 UDP: packet ids accepted behind the newest one, the room left for
/// reordering. Paths reorder by a few packets, rarely by hundreds; a
/// datagram overtaken by 1024 newer ones is dropped like a lost one. The
/// bitmap costs 136 bytes per server session; a UDP flow here is one app's
/// socket, not a whole link's traffic, so it sees little reordering.
pub const PACKET_WINDOW: u64 = 1024;
/// SIP022 UDP: server sessions one client session keeps a window for. A
/// server keeps one session per client session for the association's life
/// and starts another only when it restarts or forgets the association;
/// four covers such switches (and a replay from one of them within the
/// 30 s timestamp window) with room to spare. Each costs a cipher and a
/// 136-byte window, and exists only once the server used it.
pub const SERVER_SESSIONS: usize = 4;

/// 64-bit blocks in the packet-id ring: [`PACKET_WINDOW`] bits plus one
/// block, so the ids of a full window never share a block with ids about
/// to be cleared (RFC 6479 section 2.2).
const WINDOW_BLOCKS: u64 = PACKET_WINDOW / 64 + 1;

/// SIP022 UDP packet ids of one server session: the newest accepted id and
/// a bitmap of the [`PACKET_WINDOW`] ids before it, kept as a ring of
/// 64-bit blocks so moving forward clears blocks instead of shifting bits
/// (RFC 6479).
#[derive(Debug, Clone)]
struct PacketWindow {
    newest: u64,
    ring: [u64; WINDOW_BLOCKS as usize],
}

impl PacketWindow {
    fn new() -> Self {
        PacketWindow {
            newest: 0,
            ring: [0; WINDOW_BLOCKS as usize],
        }
    }

    /// Accept `id` once: false for an id seen before or more than
    /// [`PACKET_WINDOW`] - 1 behind the newest. Call it only for a datagram
    /// whose tag verified, or forged ids would move the window.
    fn accept(&mut self, id: u64) -> bool {
        if id > self.newest {
            // Clear the blocks between the old newest and `id` (all of them
            // when it jumped a whole ring ahead).
            let (from, to) = (self.newest / 64, id / 64);
            for b in from + 1..=to.min(from + WINDOW_BLOCKS) {
                self.ring[(b % WINDOW_BLOCKS) as usize] = 0;
            }
            self.newest = id;
        } else if self.newest - id >= PACKET_WINDOW {
            return false;
        }
        let block = &mut self.ring[((id / 64) % WINDOW_BLOCKS) as usize];
        let bit = 1u64 << (id % 64);
        if *block & bit != 0 {
            return false;
        }
        *block |= bit;
        true
    }
}

/// UDP: one datagram per packet, each self-contained (SIP004), or a session
/// with packet ids (SIP022).
pub struct UdpSession {
    key: Key,
    /// SIP022 client session id and the next packet id.
    session_id: u64,
    packet_id: u64,
    /// SIP022 body cipher for our session (keyed by session id).
    out_cipher: Option<UdpCipher>,
    /// SIP022: the server sessions that answered, most recent first, at
    /// most [`SERVER_SESSIONS`].
    servers: Vec<ServerSession>,
}

/// A SIP022 server session: its body cipher (derived from its id) and the
/// packet ids it used.
struct ServerSession {
    id: u64,
    cipher: UdpCipher,
    window: PacketWindow,
}

impl std::fmt::Debug for UdpSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UdpSession({:?})", self.key.method)
    }
}

/// SIP022 UDP with AES: the 16-byte session/packet id header is encrypted
/// with AES-ECB under the pre-shared key.
fn aes_block(key: &[u8], block: &mut [u8], encrypt: bool) -> Result<(), ShadowsocksError> {
    let bad = |_| ShadowsocksError::BadKey("AES key length".into());
    let Ok(b) = <&mut aes::Block>::try_from(block) else {
        return Err(AeadError::ShortPacket.into());
    };
    if key.len() == 16 {
        let c = aes::Aes128::new_from_slice(key).map_err(bad)?;
        if encrypt {
            c.encrypt_block(b)
        } else {
            c.decrypt_block(b)
        }
    } else {
        let c = aes::Aes256::new_from_slice(key).map_err(bad)?;
        if encrypt {
            c.encrypt_block(b)
        } else {
            c.decrypt_block(b)
        }
    }
    Ok(())
}

fn be_u64(b: &[u8]) -> Result<u64, ShadowsocksError> {
    Ok(u64::from_be_bytes(
        b.try_into().map_err(|_| AeadError::ShortPacket)?,
    ))
}

impl UdpSession {
    /// SIP022: decrypt and verify a server datagram's body in place under
    /// `cipher` (`header` is its decrypted 16-byte id header), and check
    /// the header inside: the server's type, a current timestamp and our
    /// session id. Changes no state.
    fn open_server_datagram(
        &self,
        cipher: &UdpCipher,
        header: &[u8],
        body: &mut [u8],
    ) -> Result<(), ShadowsocksError> {
        let tag = self.key.method.kind().tag_len();
        if !cipher.decrypt_packet(&header[4..16], body) {
            return Err(AeadError::Decrypt.into());
        }
        let p = &body[..body.len() - tag];
        if p[0] != TYPE_SERVER {
            return Err(AeadError::BadType(p[0]).into());
        }
        check_time(be_u64(&p[1..9])?, unix_now())?;
        if be_u64(&p[9..17])? != self.session_id {
            return Err(AeadError::NotOurs.into());
        }
        Ok(())
    }

    pub fn new(k: &Key) -> UdpSession {
        let mut id = [0u8; 8];
        random_iv_or_salt(&mut id);
        let session_id = u64::from_be_bytes(id);
        let out_cipher = k
            .method
            .is_2022()
            .then(|| UdpCipher::new(k.method.kind(), k.aead.bytes(), session_id));
        UdpSession {
            key: k.clone(),
            session_id,
            packet_id: 0,
            out_cipher,
            servers: Vec::new(),
        }
    }

    /// Append the datagram for `payload` to `target` to `out` (cleared first).
    pub fn encode(
        &mut self,
        target: &Address,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ShadowsocksError> {
        out.clear();
        let kind = self.key.method.kind();
        match self.key.method {
            Method::None => {
                target.encode(out)?;
                out.extend_from_slice(payload);
            }
            m if !m.is_2022() => {
                // Salts are at most 32 bytes (the key length); no allocation.
                let mut salt_buf = [0u8; 32];
                let salt = &mut salt_buf[..kind.salt_len().min(32)];
                random_iv_or_salt(salt);
                out.extend_from_slice(salt);
                let start = out.len();
                target.encode(out)?;
                out.extend_from_slice(payload);
                out.resize(out.len() + kind.tag_len(), 0);
                // A fresh cipher per datagram: nonce zero under a per-salt subkey.
                V1Cipher::new(kind, self.key.aead.bytes(), salt).encrypt_packet(&mut out[start..]);
            }
            _ => {
                self.packet_id = self.packet_id.wrapping_add(1);
                out.extend_from_slice(&self.session_id.to_be_bytes());
                out.extend_from_slice(&self.packet_id.to_be_bytes());
                out.push(TYPE_CLIENT);
                out.extend_from_slice(&unix_now().to_be_bytes());
                let pad = if payload.is_empty() {
                    random_padding_len()
                } else {
                    0
                };
                out.extend_from_slice(&(pad as u16).to_be_bytes());
                out.resize(out.len() + pad, 0);
                target.encode(out)?;
                out.extend_from_slice(payload);
                out.resize(out.len() + kind.tag_len(), 0);
                let (header, body) = out.split_at_mut(16);
                let Some(c) = &self.out_cipher else {
                    return Err(ShadowsocksError::BadKey("no session cipher".into()));
                };
                // The nonce is the last 12 bytes of the plaintext header.
                c.encrypt_packet(&header[4..16], body);
                aes_block(self.key.aead.bytes(), header, true)?;
            }
        }
        Ok(())
    }

    /// Decrypt a datagram from the server in place: the source address and
    /// the payload's range within `buf`.
    pub fn decode(&mut self, buf: &mut [u8]) -> Result<(Address, Range<usize>), ShadowsocksError> {
        let kind = self.key.method.kind();
        // (`tag_len` panics for `none`, which has no tag.)
        let tag = if self.key.method == Method::None {
            0
        } else {
            kind.tag_len()
        };
        let body: Range<usize> = match self.key.method {
            Method::None => 0..buf.len(),
            m if !m.is_2022() => {
                let salt_len = kind.salt_len();
                if buf.len() < salt_len + tag {
                    return Err(AeadError::ShortPacket.into());
                }
                let (salt, rest) = buf.split_at_mut(salt_len);
                if !V1Cipher::new(kind, self.key.aead.bytes(), salt).decrypt_packet(rest) {
                    return Err(AeadError::Decrypt.into());
                }
                salt_len..buf.len() - tag
            }
            _ => {
                // header(16) + type(1) + timestamp(8) + client session(8) + padding length(2)
                if buf.len() < 16 + 1 + 8 + 8 + 2 + tag {
                    return Err(AeadError::ShortPacket.into());
                }
                let (header, rest) = buf.split_at_mut(16);
                aes_block(self.key.aead.bytes(), header, false)?;
                let (server_session, packet_id) = (be_u64(&header[..8])?, be_u64(&header[8..16])?);
                // A session not seen yet is adopted only once the datagram
                // proved authentic and ours: forged datagrams (anyone can
                // send random bytes) must not evict a session and its window.
                let mut session = match self.servers.iter().position(|s| s.id == server_session) {
                    Some(i) => {
                        self.open_server_datagram(&self.servers[i].cipher, header, rest)?;
                        self.servers.remove(i)
                    }
                    None => {
                        let s = ServerSession {
                            id: server_session,
                            cipher: UdpCipher::new(kind, self.key.aead.bytes(), server_session),
                            window: PacketWindow::new(),
                        };
                        self.open_server_datagram(&s.cipher, header, rest)?;
                        s
                    }
                };
                let fresh = session.window.accept(packet_id);
                // Most recent first; the least recently used one goes.
                self.servers.insert(0, session);
                self.servers.truncate(SERVER_SESSIONS);
                if !fresh {
                    return Err(AeadError::PacketReplay(packet_id).into());
                }
                let p = &rest[..rest.len() - tag];
                let pad = usize::from(u16::from_be_bytes([p[17], p[18]]));
                let start = 16 + 19 + pad;
                let end = buf.len() - tag;
                if start > end {
                    return Err(AeadError::ShortPacket.into());
                }
                start..end
            }
        };
        let Some((addr, n)) = Address::parse(&buf[body.clone()])? else {
            return Err(AeadError::ShortPacket.into());
        };
        Ok((addr, body.start + n..body.end))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{KEYS, PSK32, target};
    use super::*;

    fn replay(id: u64) -> ShadowsocksError {
        AeadError::PacketReplay(id).into()
    }

    /// A SIP022 datagram as the server sends it, from `server` session with
    /// `packet_id`, to client session `client`.
    fn server_datagram(
        k: &Key,
        server: u64,
        packet_id: u64,
        client: u64,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&server.to_be_bytes());
        out.extend_from_slice(&packet_id.to_be_bytes());
        out.push(TYPE_SERVER);
        out.extend_from_slice(&unix_now().to_be_bytes());
        out.extend_from_slice(&client.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        target().encode(&mut out).expect("a");
        out.extend_from_slice(payload);
        out.resize(out.len() + k.method.kind().tag_len(), 0);
        let (header, body) = out.split_at_mut(16);
        UdpCipher::new(k.method.kind(), k.aead.bytes(), server)
            .encrypt_packet(&header[4..16], body);
        aes_block(k.aead.bytes(), header, true).expect("aes");
        out
    }

    #[test]
    fn packet_window_refuses_seen_and_old_ids() {
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let me = s.session_id;
        let mut dec = |id: u64| {
            s.decode(&mut server_datagram(&k, 7, id, me, b"pong"))
                .map(|_| ())
        };
        assert_eq!(dec(1), Ok(()));
        assert_eq!(dec(1), Err(replay(1)));
        // Reordering inside the window is fine, once per id.
        assert_eq!(dec(3), Ok(()));
        assert_eq!(dec(2), Ok(()));
        assert_eq!(dec(2), Err(replay(2)));
        // A jump ahead: PACKET_WINDOW - 1 behind the newest is the oldest
        // accepted; one more is too old, seen or not.
        let top = 5000;
        assert_eq!(dec(top), Ok(()));
        assert_eq!(dec(top - PACKET_WINDOW + 1), Ok(()));
        assert_eq!(dec(top - PACKET_WINDOW), Err(replay(top - PACKET_WINDOW)));
        assert_eq!(dec(3), Err(replay(3)));
        // Every id of a full window once, in reverse, then none again.
        let mut w = PacketWindow::new();
        assert!(w.accept(10_000));
        for id in (10_000 - PACKET_WINDOW + 1..10_000).rev() {
            assert!(w.accept(id), "{id}");
        }
        for id in 10_000 - PACKET_WINDOW + 1..=10_000 {
            assert!(!w.accept(id), "{id} twice");
        }
        // Moving by less than a block keeps the bits of the ids still inside.
        assert!(w.accept(10_001));
        assert!(!w.accept(10_000 - PACKET_WINDOW + 2));
    }

    /// Datagrams whose tag fails change nothing: they neither evict the
    /// server session (and with it the memory of its packet ids) nor
    /// install a session of their own. An authentic new server session
    /// (the server restarted) is adopted beside the old one.
    #[test]
    fn forged_datagrams_change_no_state() {
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let me = s.session_id;
        let first = server_datagram(&k, 7, 1, me, b"pong");
        s.decode(&mut first.clone()).expect("authentic");
        for forged_session in 100..100 + SERVER_SESSIONS as u64 + 1 {
            let mut d = server_datagram(&k, forged_session, 1, me, b"pong");
            let last = d.len() - 1;
            d[last] ^= 1;
            assert_eq!(s.decode(&mut d), Err(AeadError::Decrypt.into()));
        }
        let ids: Vec<u64> = s.servers.iter().map(|x| x.id).collect();
        assert_eq!(ids, [7], "forged datagrams adopted nothing");
        assert_eq!(
            s.decode(&mut first.clone()),
            Err(replay(1)),
            "session 7 still remembers packet 1"
        );
        // Datagrams for another client session verify but are not ours.
        let mut other = server_datagram(&k, 8, 1, me ^ 1, b"pong");
        assert_eq!(s.decode(&mut other), Err(AeadError::NotOurs.into()));
        assert_eq!(s.servers.len(), 1);
        // A real new server session, then the old one again: both kept.
        s.decode(&mut server_datagram(&k, 8, 1, me, b"pong"))
            .expect("new server session");
        s.decode(&mut server_datagram(&k, 7, 2, me, b"pong"))
            .expect("old session continues");
        assert_eq!(
            s.decode(&mut server_datagram(&k, 8, 1, me, b"pong")),
            Err(replay(1))
        );
        let ids: Vec<u64> = s.servers.iter().map(|x| x.id).collect();
        assert_eq!(ids, [8, 7], "most recent first");
        // Bounded: more sessions than SERVER_SESSIONS evict the least recent.
        for id in 20..20 + SERVER_SESSIONS as u64 {
            s.decode(&mut server_datagram(&k, id, 1, me, b"pong"))
                .expect("session");
        }
        assert_eq!(s.servers.len(), SERVER_SESSIONS);
        assert!(s.servers.iter().all(|x| x.id >= 20));
    }

    #[test]
    fn udp_round_trip_all_methods() {
        // SIP004 (and no cipher): every datagram stands alone.
        for (m, pw) in KEYS.into_iter().filter(|&(m, _)| !m.is_2022()) {
            let k = Key::new(m, pw).expect("k");
            let mut s = UdpSession::new(&k);
            let mut out = Vec::new();
            s.encode(&target(), b"ping", &mut out).expect("enc");
            // SIP004 datagrams are symmetric: the client can decode its own.
            let (a, r) = s.decode(&mut out).expect("dec");
            assert_eq!(a, target());
            assert_eq!(&out[r], b"ping");
        }
        // SIP022: the client refuses its own datagram (type 0, not the server's).
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let mut out = Vec::new();
        s.encode(&target(), b"ping", &mut out).expect("enc");
        assert_eq!(
            s.decode(&mut out.clone()),
            Err(AeadError::BadType(0).into())
        );
        assert_eq!(
            s.decode(&mut out[..20].to_vec()),
            Err(AeadError::ShortPacket.into())
        );
    }
}
