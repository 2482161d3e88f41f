/* AMQP 1.0 sender for the benchmark: sends COUNT durable messages of SIZE bytes (a send
 * timestamp inside) to ADDRESS, unsettled, with at most WINDOW awaiting their disposition,
 * and counts the outcomes. Prints "ready" once the link has credit, waits for a line on
 * stdin ("go"), then sends; at the end prints one JSON line.
 *
 *   send HOST PORT ADDRESS COUNT SIZE WINDOW SASL(0|1)
 */
#include "common.h"

static const char *address;
static long count, window, sent, settled, accepted, other;
static int started;
static char *encoded;   /* the message, encoded once; only the timestamp changes */
static size_t encoded_len, ts_offset;
static int64_t t_go, t_end;

/* Encode one message with a placeholder timestamp; later sends patch it in place, which keeps
 * the generator's cost per message far below any broker's. */
static void encode_template(long size) {
  pn_message_t *m = pn_message();
  char *body = malloc(size < 32 ? 32 : size);
  memset(body, 'x', size < 32 ? 32 : size);
  memcpy(body, TS_MARK "0000000000000000000", strlen(TS_MARK) + TS_DIGITS);
  pn_message_set_durable(m, true);
  pn_data_put_binary(pn_message_body(m), pn_bytes(size < 32 ? 32 : size, body));
  encoded_len = 256 + (size_t)size;
  encoded = malloc(encoded_len);
  if (pn_message_encode(m, encoded, &encoded_len)) {
    fprintf(stderr, "encode failed\n");
    exit(1);
  }
  char *mark = memmem(encoded, encoded_len, TS_MARK, strlen(TS_MARK));
  ts_offset = (size_t)(mark - encoded) + strlen(TS_MARK);
  pn_message_free(m);
  free(body);
}

static void send_more(pn_link_t *l) {
  char digits[TS_DIGITS + 1];
  while (sent < count && sent - settled < window && pn_link_credit(l) > 0) {
    uint64_t tag = (uint64_t)sent;
    pn_delivery(l, pn_dtag((const char *)&tag, sizeof tag));
    snprintf(digits, sizeof digits, "%019lld", (long long)now_ns());
    memcpy(encoded + ts_offset, digits, TS_DIGITS);
    pn_link_send(l, encoded, encoded_len);
    pn_link_advance(l);
    sent++;
  }
}

static int handle(pn_event_t *e) {
  switch (pn_event_type(e)) {
  case PN_CONNECTION_INIT: {
    pn_connection_t *c = pn_event_connection(e);
    pn_connection_set_container(c, "bench-send");
    pn_connection_open(c);
    pn_session_t *s = pn_session(c);
    pn_session_open(s);
    pn_link_t *l = pn_sender(s, "bench-sender");
    pn_terminus_set_address(pn_link_target(l), address);
    pn_link_open(l);
    break;
  }
  case PN_LINK_FLOW: {
    pn_link_t *l = pn_event_link(e);
    if (!started && pn_link_credit(l) > 0) {
      char line[64];
      printf("ready\n");
      fflush(stdout);
      if (!fgets(line, sizeof line, stdin)) exit(1);
      started = 1;
      t_go = now_ns();
    }
    if (started) send_more(l);
    break;
  }
  case PN_DELIVERY: {
    pn_delivery_t *d = pn_event_delivery(e);
    if (pn_delivery_updated(d) && pn_delivery_remote_state(d)) {
      if (pn_delivery_remote_state(d) == PN_ACCEPTED) accepted++; else other++;
      pn_delivery_settle(d);
      settled++;
      if (settled == count) {
        t_end = now_ns();
        pn_connection_close(pn_event_connection(e));
      } else {
        send_more(pn_event_link(e));
      }
    }
    break;
  }
  case PN_LINK_REMOTE_CLOSE:
    check_condition("link", pn_link_remote_condition(pn_event_link(e)));
    break;
  case PN_TRANSPORT_CLOSED:
    if (settled < count) check_condition("transport", pn_transport_condition(pn_event_transport(e)));
    return 1;
  default:
    break;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: send HOST PORT ADDRESS COUNT SIZE WINDOW SASL\n");
    return 2;
  }
  address = argv[3];
  count = atol(argv[4]);
  window = atol(argv[6]);
  encode_template(atol(argv[5]));
  pn_proactor_t *p = pn_proactor();
  loadgen_connect(p, argv[1], argv[2], atoi(argv[7]));
  for (int done = 0; !done;) {
    pn_event_batch_t *b = pn_proactor_wait(p);
    for (pn_event_t *e; !done && (e = pn_event_batch_next(b));) done = handle(e);
    pn_proactor_done(p, b);
  }
  pn_proactor_free(p);
  printf("{\"sent\": %ld, \"accepted\": %ld, \"other\": %ld, \"go_ns\": %lld, \"end_ns\": %lld}\n",
         sent, accepted, other, (long long)t_go, (long long)t_end);
  return settled == count && other == 0 ? 0 : 1;
}
