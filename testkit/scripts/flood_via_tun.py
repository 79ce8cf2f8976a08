"""Inject a bounded flood into a TUN device's transmit side (the engine
reading the TUN receives it, as if an app on the device had sent it), as
fast as possible, and print the number handed to the kernel.

usage: flood_via_tun.py IFNAME KIND COUNT SEED DST4 DST6 [PORT [SRC SPORT]]

KIND:
  malformed-l4  IP-valid packets with broken L4, both families: TCP SYNs and
                data with a bad checksum, TCP with flag combinations no
                endpoint sends (none, FIN alone, SYN+FIN, SYN+RST, Xmas...)
                and a valid checksum, UDP with a bad checksum, UDP over IPv6
                with a zero checksum, UDP whose length field overruns the
                packet. Destinations are DST4/DST6 on random ports.
  malformed-ip  packets the IP layer refuses or does not carry: random
                bytes, truncated headers, bad total/payload lengths and
                header lengths, IPv4 and IPv6 fragments that never
                complete, ESP, TCP with a bad data offset, unknown
                protocols. Fixed addresses (10.0.0.9 -> 198.19.1.2, ::9 ->
                fd00:19::2): only the fragments get as far as their
                addresses, and they share one id, so none ever completes.
  syn           valid TCP SYNs to DST4:PORT / [DST6]:PORT from spoofed
                sources (198.18.0.0/16 hosts .1.0-.255.255 and fd00:18::/64
                hosts that no namespace owns), so no SYN is ever answered.
  syn-on        valid TCP SYNs with random sequence numbers on one 4-tuple,
                SRC:SPORT -> DST4:PORT (DST6 if SRC is IPv6): spoofed onto
                a connection that is live.
  udp           valid UDP datagrams (64 bytes) to DST4/DST6 on COUNT
                distinct ports from one source port: a one-way flood.

The IPv4 source of malformed-l4 and udp packets is 198.18.0.9, IPv6
fd00:18::9: addresses inside the TUN's prefixes that no namespace owns.
The tests drive it through kerntun_testkit::rig::Rig::inject.
"""
import random
import socket
import struct
import sys


def csum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def finish(s):
    c = ~s & 0xFFFF
    return c or 0xFFFF


def v4(src, dst, proto, l4):
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0x4000, 64, proto, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))
    c = ~csum(hdr) & 0xFFFF
    return hdr[:10] + struct.pack("!H", c) + hdr[12:] + l4


def v6(src, dst, nh, l4):
    return (struct.pack("!IHBB", 6 << 28, len(l4), nh, 64)
            + socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + l4)


def pseudo(src, dst, proto, length, six):
    if six:
        return (socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst)
                + struct.pack("!IxxxB", length, proto))
    return socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!xBH", proto, length)


def tcp(src, dst, sport, dport, flags, payload=b"", six=False, good=True, seq=1):
    seg = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, flags, 65535, 0, 0) + payload
    c = finish(csum(pseudo(src, dst, 6, len(seg), six) + seg))
    if not good:
        c = c ^ 0x5A5A or 0x1234
    seg = seg[:16] + struct.pack("!H", c) + seg[18:]
    return (v6 if six else v4)(src, dst, 6, seg)


def udp(src, dst, sport, dport, payload, six=False, good=True, zero=False, length=None):
    if zero:
        # A zero over IPv6 is "no checksum", invalid (RFC 8200 8.1); the
        # engine still takes it when the true sum is +0 (0x0000 and 0xFFFF
        # are the same value, and tun-rs can complete a checksum as 0), so
        # keep clear of that one case.
        seg = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
        if finish(csum(pseudo(src, dst, 17, len(seg), six) + seg)) == 0xFFFF:
            payload = payload[:-1] + bytes([payload[-1] ^ 1])
    ulen = 8 + len(payload) if length is None else length
    seg = struct.pack("!HHHH", sport, dport, ulen, 0) + payload
    c = 0 if zero else finish(csum(pseudo(src, dst, 17, 8 + len(payload), six) + seg))
    if not good:
        # Never 0: over IPv4 that means "no checksum", which is valid.
        c = c ^ 0x5A5A or 0x1234
    seg = seg[:6] + struct.pack("!H", c) + seg[8:]
    return (v6 if six else v4)(src, dst, 17, seg)


FIN, SYN, RST, PSH, ACK, URG = 1, 2, 4, 8, 16, 32
BAD_FLAGS = [0, FIN, SYN | FIN, SYN | RST, FIN | PSH | URG, SYN | FIN | RST | PSH | ACK | URG,
             RST | FIN, SYN | FIN | ACK, FIN | URG]


def malformed(rnd, dst4, dst6):
    six = rnd.random() < 0.5
    src, dst = ("fd00:18::9", dst6) if six else ("198.18.0.9", dst4)
    sport, dport = rnd.randrange(1024, 65535), rnd.randrange(1, 65535)
    k = rnd.randrange(7)
    if k == 0:
        return tcp(src, dst, sport, dport, SYN, six=six, good=False)
    if k == 1:
        return tcp(src, dst, sport, dport, ACK | PSH, b"x" * rnd.randrange(1, 200), six=six, good=False)
    if k == 2:
        return tcp(src, dst, sport, dport, rnd.choice(BAD_FLAGS), six=six)
    if k == 3:
        return udp(src, dst, sport, dport, b"q" * rnd.randrange(0, 200), six=six, good=False)
    if k == 4:
        # A zero checksum: "none" over IPv4 (valid, so use IPv6 here).
        return udp("fd00:18::9", dst6, sport, dport, b"z" * 20, six=True, zero=True)
    if k == 5:
        return udp(src, dst, sport, dport, b"l" * 20, six=six, length=200)
    return tcp(src, dst, sport, dport, SYN, six=six, good=False, seq=rnd.getrandbits(32))


def raw_v4(proto, payload, flags_frag=0, total=None, ihl=5):
    """An IPv4 header as given, its checksum left 0."""
    total = 20 + len(payload) if total is None else total
    return struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, total & 0xFFFF, 1, flags_frag, 64,
                       proto, 0, bytes([10, 0, 0, 9]), bytes([198, 19, 1, 2])) + payload


def raw_v6(nh, payload, plen=None):
    plen = len(payload) if plen is None else plen
    return (struct.pack("!IHBB", 6 << 28, plen & 0xFFFF, nh, 64) + bytes(15) + b"\x09"
            + bytes([0xFD, 0, 0, 0x19] + [0] * 11 + [2]) + payload)


def raw_tcp(doff=5):
    return struct.pack("!HHIIBBHHH", 40000, 443, 1, 0, doff << 4, 0x02, 1024, 0, 0)


def malformed_ip(rnd):
    k = rnd.randrange(11)
    if k == 0:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 120)))
    if k == 1:
        return raw_v4(6, raw_tcp())[: rnd.randrange(1, 20)]                  # truncated IPv4 header
    if k == 2:
        return raw_v4(6, raw_tcp(), total=rnd.choice([0, 10, 19, 4000]))     # bad total length
    if k == 3:
        return raw_v4(17, bytes(16), flags_frag=0x2000)                      # MF set
    if k == 4:
        return raw_v4(17, bytes(16), flags_frag=0x0005)                      # offset set
    if k == 5:
        return raw_v6(44, bytes([17, 0, 0, 1, 0, 0, 0, 1]) + bytes(16))     # IPv6 Fragment header
    if k == 6:
        return raw_v6(50, bytes(24))                                          # ESP
    if k == 7:
        return raw_v4(6, raw_tcp(doff=rnd.choice([0, 1, 4, 15])))             # bad data offset
    if k == 8:
        return raw_v4(rnd.choice([47, 132, 253]), bytes(20))                  # unknown protocol
    if k == 9:
        return raw_v6(6, raw_tcp(), plen=rnd.choice([0, 5, 3000]))            # bad payload length
    return raw_v4(6, raw_tcp(), ihl=rnd.choice([0, 3, 4, 15]))                # bad IHL


def main():
    ifname, kind, count, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dst4, dst6 = sys.argv[5], sys.argv[6]
    port = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    rnd = random.Random(seed)
    socks = {}
    for proto in (0x0800, 0x86DD):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(proto))
        s.bind((ifname, proto))
        socks[proto] = s
    sent = 0
    for i in range(count):
        if kind == "malformed-l4":
            p = malformed(rnd, dst4, dst6)
        elif kind == "malformed-ip":
            p = malformed_ip(rnd)
        elif kind == "syn":
            six = i % 2 == 1
            n = 256 + i // 2
            if six:
                src = "fd00:18::%x:%x" % (1 + n // 65536, n % 65536)
                p = tcp(src, dst6, 1024 + n % 60000, port, SYN, six=True, seq=rnd.getrandbits(32))
            else:
                src = "198.18.%d.%d" % ((n // 256) % 256, n % 256)
                p = tcp(src, dst4, 1024 + (n // 65536) % 60000, port, SYN, seq=rnd.getrandbits(32))
        elif kind == "syn-on":
            src, sport = sys.argv[8], int(sys.argv[9])
            six = ":" in src
            p = tcp(src, dst6 if six else dst4, sport, port, SYN, six=six, seq=rnd.getrandbits(32))
        elif kind == "udp":
            six = i % 2 == 1
            src, dst = ("fd00:18::9", dst6) if six else ("198.18.0.9", dst4)
            p = udp(src, dst, 40000, 1 + i % 65000, bytes(64), six=six)
        else:
            raise SystemExit("unknown kind " + kind)
        proto = 0x86DD if p and p[0] >> 4 == 6 else 0x0800
        try:
            socks[proto].sendto(p, (ifname, proto))
            sent += 1
        except OSError:
            pass
    print(sent)


main()
