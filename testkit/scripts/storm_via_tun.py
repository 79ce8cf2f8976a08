"""Inject COUNT malformed packets into a TUN device's transmit side (the
engine reading the TUN receives them) as fast as possible: random bytes,
truncated headers, bad lengths, IPv4 and IPv6 fragments, ESP, bad TCP data
offsets, unknown protocols. Prints the number actually handed to the kernel.

usage: storm_via_tun.py IFNAME COUNT SEED
"""
import random
import socket
import struct
import sys


def v4(proto, payload, flags_frag=0, total=None, ihl=5):
    total = 20 + len(payload) if total is None else total
    return struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, total & 0xFFFF, 1, flags_frag, 64,
                       proto, 0, bytes([10, 0, 0, 9]), bytes([198, 19, 1, 2])) + payload


def v6(nh, payload, plen=None):
    plen = len(payload) if plen is None else plen
    return (struct.pack("!IHBB", 6 << 28, plen & 0xFFFF, nh, 64) + bytes(15) + b"\x09"
            + bytes([0xFD, 0, 0, 0x19] + [0] * 11 + [2]) + payload)


def tcp(doff=5):
    return struct.pack("!HHIIBBHHH", 40000, 443, 1, 0, doff << 4, 0x02, 1024, 0, 0)


def make(rnd):
    k = rnd.randrange(11)
    if k == 0:
        return bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 120)))
    if k == 1:
        return v4(6, tcp())[: rnd.randrange(1, 20)]                      # truncated IPv4 header
    if k == 2:
        return v4(6, tcp(), total=rnd.choice([0, 10, 19, 4000]))          # bad total length
    if k == 3:
        return v4(17, bytes(16), flags_frag=0x2000)                      # MF set
    if k == 4:
        return v4(17, bytes(16), flags_frag=0x0005)                      # offset set
    if k == 5:
        return v6(44, bytes([17, 0, 0, 1, 0, 0, 0, 1]) + bytes(16))     # IPv6 Fragment header
    if k == 6:
        return v6(50, bytes(24))                                          # ESP
    if k == 7:
        return v4(6, tcp(doff=rnd.choice([0, 1, 4, 15])))                 # bad data offset
    if k == 8:
        return v4(rnd.choice([47, 132, 253]), bytes(20))                  # unknown protocol
    if k == 9:
        return v6(6, tcp(), plen=rnd.choice([0, 5, 3000]))                # bad payload length
    return v4(6, tcp(), ihl=rnd.choice([0, 3, 4, 15]))                    # bad IHL


def main():
    ifname, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rnd = random.Random(seed)
    socks = {}
    for proto in (0x0800, 0x86DD):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(proto))
        s.bind((ifname, proto))
        socks[proto] = s
    sent = 0
    for _ in range(count):
        p = make(rnd)
        proto = 0x86DD if p and p[0] >> 4 == 6 else 0x0800
        try:
            socks[proto].sendto(p, (ifname, proto))
            sent += 1
        except OSError:
            pass
    print(sent)


main()
