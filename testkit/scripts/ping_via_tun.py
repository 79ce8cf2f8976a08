"""Send one ICMP/ICMPv6 echo request into a TUN device's transmit side with an
AF_PACKET socket (so the process reading the TUN receives it, as it would a
packet routed into the tunnel), then wait for the echo reply that process
writes back, checking type, identifier, sequence, payload and checksum.

usage: ping_via_tun.py IFNAME SRC DST   (exit 0 = valid reply within 3 s)
"""
import socket
import struct
import sys
import time

PACKET_OUTGOING = 4


def csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


def main() -> int:
    ifname, src, dst = sys.argv[1:4]
    v6 = ":" in dst
    proto = 0x86DD if v6 else 0x0800
    s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(proto))
    s.bind((ifname, proto))
    ident, seq, payload = 0x4B54, 7, b"kerntun-echo" * 4
    if v6:
        a, b = socket.inet_pton(socket.AF_INET6, src), socket.inet_pton(socket.AF_INET6, dst)
        icmp = struct.pack("!BBHHH", 128, 0, 0, ident, seq) + payload
        pseudo = a + b + struct.pack("!I3xB", len(icmp), 58)
        icmp = icmp[:2] + struct.pack("!H", csum(pseudo + icmp)) + icmp[4:]
        pkt = struct.pack("!IHBB", 6 << 28, len(icmp), 58, 64) + a + b + icmp
    else:
        a, b = socket.inet_aton(src), socket.inet_aton(dst)
        icmp = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + payload
        icmp = icmp[:2] + struct.pack("!H", csum(icmp)) + icmp[4:]
        ip = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(icmp), 0, 0, 64, 1, 0) + a + b
        ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
        pkt = ip + icmp
    s.sendto(pkt, (ifname, proto))
    s.settimeout(0.2)
    deadline = time.time() + 3
    while time.time() < deadline:
        try:
            data, addr = s.recvfrom(65535)
        except socket.timeout:
            continue
        if addr[2] == PACKET_OUTGOING:
            continue
        if v6:
            if len(data) < 48 or data[6] != 58 or data[8:24] != b or data[24:40] != a:
                continue
            ic = data[40:]
            ok_sum = csum(data[8:24] + data[24:40] + struct.pack("!I3xB", len(ic), 58) + ic) == 0
            want_type = 129
        else:
            ihl = (data[0] & 15) * 4
            if len(data) < ihl + 8 or data[9] != 1 or data[12:16] != b or data[16:20] != a:
                continue
            ic = data[ihl:]
            ok_sum = csum(ic) == 0 and csum(data[:ihl]) == 0
            want_type = 0
        if ic[0] == want_type and ic[4:8] == struct.pack("!HH", ident, seq) and ic[8:] == payload:
            print("reply" if ok_sum else "reply with a bad checksum")
            return 0 if ok_sum else 1
    print("no reply")
    return 1


sys.exit(main())
