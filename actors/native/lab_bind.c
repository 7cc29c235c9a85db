/* The lab's source-address binder (orchestrator/lab.py), preloaded into lab workers.

   gloo connects its sockets without binding them, so the kernel gives every loopback connection the
   source 127.0.0.1, and traffic from two virtual nodes could not be told apart by the shaping rules.
   This connect() binds an unbound IPv4 socket to $ORCHESTRATOR_LAB_SOURCE (the worker's virtual
   node's address) before connecting to an address inside $ORCHESTRATOR_LAB_NET (the lab's /24),
   and leaves every other connection (Ray's own, anything outside the lab) as it is. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static connect_fn real = NULL;
    if (!real) real = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *source = getenv("ORCHESTRATOR_LAB_SOURCE");
    const char *net = getenv("ORCHESTRATOR_LAB_NET");
    if (source && net && addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        char base[32]; int bits = 16; struct in_addr netaddr, src;
        if (sscanf(net, "%31[^/]/%d", base, &bits) == 2 && inet_pton(AF_INET, base, &netaddr) == 1
                && inet_pton(AF_INET, source, &src) == 1 && bits >= 0 && bits <= 32) {
            unsigned mask = bits ? 0xffffffffu << (32 - bits) : 0;
            unsigned dst = ntohl(((const struct sockaddr_in *)addr)->sin_addr.s_addr);
            if ((dst & mask) == (ntohl(netaddr.s_addr) & mask)) {
                struct sockaddr_in local; socklen_t l = sizeof local;
                memset(&local, 0, sizeof local);
                if (getsockname(fd, (struct sockaddr *)&local, &l) == 0 && local.sin_family == AF_INET
                        && local.sin_port == 0 && local.sin_addr.s_addr == htonl(INADDR_ANY)) {
                    struct sockaddr_in from; memset(&from, 0, sizeof from);
                    from.sin_family = AF_INET; from.sin_addr = src;
                    bind(fd, (struct sockaddr *)&from, sizeof from);
                }
            }
        }
    }
    return real(fd, addr, len);
}
