/* Shared helpers of the AMQP 1.0 load generator (send.c, recv.c): clock, connect, errors.
 * Both programs speak to any AMQP 1.0 broker through the Qpid Proton C proactor, so every
 * broker under test is driven by the same client code. */
#ifndef LOADGEN_COMMON_H
#define LOADGEN_COMMON_H

#define _GNU_SOURCE /* memmem */

#include <proton/condition.h>
#include <proton/connection.h>
#include <proton/delivery.h>
#include <proton/event.h>
#include <proton/link.h>
#include <proton/message.h>
#include <proton/proactor.h>
#include <proton/sasl.h>
#include <proton/session.h>
#include <proton/transport.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The payload carries "TS:" + 19 decimal digits of CLOCK_REALTIME ns; the receiver finds
 * it in the raw delivery bytes, so it works whatever section framing the broker re-encodes. */
#define TS_MARK "TS:"
#define TS_DIGITS 19

static inline int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Connect over TCP; with use_sasl the client offers SASL ANONYMOUS (RabbitMQ needs a SASL
 * layer, the gateway accepts a bare AMQP header). */
static inline void loadgen_connect(pn_proactor_t *p, const char *host, const char *port,
                                   int use_sasl) {
  char addr[PN_MAX_ADDR];
  pn_transport_t *t = pn_transport();
  if (use_sasl) {
    pn_sasl_allowed_mechs(pn_sasl(t), "ANONYMOUS");
  }
  pn_proactor_addr(addr, sizeof addr, host, port);
  pn_proactor_connect2(p, pn_connection(), t, addr);
}

/* Print a remote/local error condition and exit: a failed run must not look like a result. */
static inline void check_condition(const char *what, pn_condition_t *c) {
  if (c && pn_condition_is_set(c)) {
    fprintf(stderr, "%s: %s: %s\n", what, pn_condition_get_name(c),
            pn_condition_get_description(c));
    exit(1);
  }
}

#endif
