/* AMQP 1.0 receiver for the benchmark: receives COUNT messages from ADDRESS with WINDOW
 * credit, accepts and settles each, and measures end-to-end latency from the send timestamp
 * in the payload. Prints "ready" once the link is attached, then one JSON line at the end.
 *
 *   recv HOST PORT ADDRESS COUNT WINDOW SASL(0|1) [IDLE_MS [LAT_FILE]]
 *
 * Competing consumers cannot know their share of COUNT: with IDLE_MS > 0 the receiver also
 * ends IDLE_MS after its last message once it got SIGUSR1 (sent when every sender is done).
 * LAT_FILE receives the latencies (int64 ns, native order) so a driver can merge receivers.
 */
#include "common.h"

#include <signal.h>

static const char *address, *lat_file;
static long count, window, received, no_stamp, idle_ms;
static int64_t *lat_ns, first_ns, last_ns, armed_ns;
static volatile sig_atomic_t armed;
static pn_connection_t *connection;
static pn_proactor_t *proactor;

static void on_usr1(int sig) {
  (void)sig;
  armed = 1;
}

/* Every 50 ms: once armed, end after IDLE_MS without a message. */
static void check_idle(void) {
  int64_t now = now_ns();
  if (armed && !armed_ns) armed_ns = now;
  int64_t since = last_ns > armed_ns ? last_ns : armed_ns;
  if (armed && connection && now - since >= idle_ms * 1000000) {
    pn_connection_wake(connection);  /* closed on its own PN_CONNECTION_WAKE */
  } else {
    pn_proactor_set_timeout(proactor, 50);
  }
}
static char *buf;
static size_t buf_cap = 1 << 16, buf_len;

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static double pct_us(double q) {
  long i = (long)(q * (double)received);
  if (i >= received) i = received - 1;
  return received ? (double)lat_ns[i] / 1000.0 : 0.0;
}

/* Read the raw bytes of the current delivery and take the timestamp from them. */
static void on_message(pn_link_t *l, pn_delivery_t *d) {
  for (ssize_t n; (n = pn_link_recv(l, buf + buf_len, buf_cap - buf_len)) > 0;) {
    buf_len += (size_t)n;
    if (buf_len == buf_cap) buf = realloc(buf, buf_cap *= 2);
  }
  if (pn_delivery_partial(d)) return;  /* more frames of this message to come */
  int64_t now = now_ns();
  char *mark = memmem(buf, buf_len, TS_MARK, strlen(TS_MARK));
  if (mark && buf_len - (size_t)(mark - buf) >= strlen(TS_MARK) + TS_DIGITS) {
    char digits[TS_DIGITS + 1];
    memcpy(digits, mark + strlen(TS_MARK), TS_DIGITS);
    digits[TS_DIGITS] = 0;
    if (received < count) lat_ns[received] = now - atoll(digits);
  } else {
    no_stamp++;
  }
  buf_len = 0;
  pn_link_advance(l);
  pn_delivery_update(d, PN_ACCEPTED);
  pn_delivery_settle(d);
  if (received == 0) first_ns = now;
  last_ns = now;
  received++;
  int credit = pn_link_credit(l);
  if (received >= count) {
    pn_connection_close(pn_session_connection(pn_link_session(l)));
  } else if (credit < window / 2) {
    pn_link_flow(l, (int)window - credit);  /* top up in batches, not one flow per message */
  }
}

static int handle(pn_event_t *e) {
  switch (pn_event_type(e)) {
  case PN_CONNECTION_INIT: {
    pn_connection_t *c = pn_event_connection(e);
    connection = c;
    pn_connection_set_container(c, "bench-recv");
    pn_connection_open(c);
    pn_session_t *s = pn_session(c);
    pn_session_open(s);
    pn_link_t *l = pn_receiver(s, "bench-receiver");
    pn_terminus_set_address(pn_link_source(l), address);
    pn_link_open(l);
    pn_link_flow(l, (int)window);
    break;
  }
  case PN_LINK_REMOTE_OPEN:
    printf("ready\n");
    fflush(stdout);
    break;
  case PN_DELIVERY: {
    pn_delivery_t *d = pn_event_delivery(e);
    if (pn_delivery_readable(d)) on_message(pn_event_link(e), d);
    break;
  }
  case PN_CONNECTION_WAKE:
    pn_connection_close(pn_event_connection(e));
    break;
  case PN_PROACTOR_TIMEOUT:
    check_idle();
    break;
  case PN_LINK_REMOTE_CLOSE:
    check_condition("link", pn_link_remote_condition(pn_event_link(e)));
    break;
  case PN_TRANSPORT_CLOSED:
    if (received < count && !armed) check_condition("transport", pn_transport_condition(pn_event_transport(e)));
    return 1;
  default:
    break;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 7 || argc > 9) {
    fprintf(stderr, "usage: recv HOST PORT ADDRESS COUNT WINDOW SASL [IDLE_MS [LAT_FILE]]\n");
    return 2;
  }
  address = argv[3];
  count = atol(argv[4]);
  window = atol(argv[5]);
  idle_ms = argc > 7 ? atol(argv[7]) : 0;
  lat_file = argc > 8 ? argv[8] : NULL;
  signal(SIGUSR1, on_usr1);
  lat_ns = calloc((size_t)count, sizeof *lat_ns);
  buf = malloc(buf_cap);
  pn_proactor_t *p = proactor = pn_proactor();
  if (idle_ms > 0) pn_proactor_set_timeout(p, 50);
  loadgen_connect(p, argv[1], argv[2], atoi(argv[6]));
  for (int done = 0; !done;) {
    pn_event_batch_t *b = pn_proactor_wait(p);
    for (pn_event_t *e; !done && (e = pn_event_batch_next(b));) done = handle(e);
    pn_proactor_done(p, b);
  }
  pn_proactor_free(p);
  long stamped = received - no_stamp;
  qsort(lat_ns, (size_t)(stamped < count ? stamped : count), sizeof *lat_ns, cmp_i64);
  long saved = received;
  received = stamped < count ? stamped : count;  /* percentiles over stamped messages */
  if (lat_file) {
    FILE *f = fopen(lat_file, "wb");
    if (!f || fwrite(lat_ns, sizeof *lat_ns, (size_t)received, f) != (size_t)received) {
      perror(lat_file);
      return 1;
    }
    fclose(f);
  }
  printf("{\"received\": %ld, \"no_stamp\": %ld, \"first_ns\": %lld, \"last_ns\": %lld, "
         "\"p50_us\": %.1f, \"p99_us\": %.1f, \"p999_us\": %.1f, \"max_us\": %.1f}\n",
         saved, no_stamp, (long long)first_ns, (long long)last_ns, pct_us(0.50), pct_us(0.99),
         pct_us(0.999), pct_us(1.0));
  return (saved >= count || idle_ms > 0) && no_stamp == 0 ? 0 : 1;
}
