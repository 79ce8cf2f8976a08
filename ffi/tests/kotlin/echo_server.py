"""TCP and UDP echo server for the Kotlin FFI test, run inside the server
namespace by run.sh. Serves every address given on the command line until
killed; each TCP connection echoes until the peer half-closes. On the port
plus 80, a minimal HTTP server answers every request with 204, the target
of the test's latency probes (Engine.testLatency, fallback groups)."""

import socket
import sys
import threading


def tcp_conn(c):
    with c:
        while True:
            data = c.recv(65536)
            if not data:
                c.shutdown(socket.SHUT_WR)
                return
            c.sendall(data)


def tcp(addr, port):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=tcp_conn, args=(c,), daemon=True).start()


def http_conn(c):
    with c:
        head = b""
        while b"\r\n\r\n" not in head:
            data = c.recv(4096)
            if not data:
                return
            head += data
        c.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")


def http(addr, port):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port + 80))
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=http_conn, args=(c,), daemon=True).start()


def udp(addr, port):
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.bind((addr, port))
    while True:
        data, peer = s.recvfrom(65536)
        s.sendto(data, peer)


def main():
    port = int(sys.argv[1])
    threads = []
    for addr in sys.argv[2:]:
        for fn in (tcp, udp, http):
            t = threading.Thread(target=fn, args=(addr, port), daemon=True)
            t.start()
            threads.append(t)
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
