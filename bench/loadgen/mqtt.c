/* MQTT load generator for the benchmarks: plain C, one epoll loop, no library beyond libc.
 *
 * A Python MQTT client costs more CPU per message than the brokers under test, so it caps
 * them; this one costs a few µs per message. Build: gcc -O2 -Wall -o mqttgen mqtt.c -lm
 *
 * Modes (first argument), one JSON object on stdout at the end, errors on stderr, exit 1:
 *   pubsub  N subscribers (topic <prefix><i>) and N publishers; publisher i sends its share
 *           of --messages to <prefix><i>; ends when all arrived or after --timeout.
 *   pub     the publishers only (e.g. for an AMQP consumer on the other side).
 *   sub     the subscribers only; prints {"subscribed": n, "seconds": t} once all SUBACKs
 *           came, waits for --messages (x --subscribers with a shared --subscribe-topic)
 *           and reports latency.
 *   idle    --connections plain connections (at most --ramp handshakes at a time); prints
 *           {"connected": n, "seconds": t} when all are up, holds them until stdin closes or
 *           --hold seconds pass, disconnects, prints a final JSON line.
 *
 * Payload: bytes 0-7 CLOCK_MONOTONIC send time (ns, little endian), bytes 8-15 the message
 * sequence number (0 .. messages-1 over all publishers), then, if --size allows, "TS:" and 19
 * digits of CLOCK_REALTIME ns (what the AMQP receiver bench/loadgen/recv.c reads), padded to
 * --size with 'x'. Latency is measured from the monotonic stamp: same host only.
 *
 * Flow control: QoS 1 publishers keep at most --inflight unacked PUBLISHes each. QoS 0 has no
 * acks, so in pubsub mode publishers stop while sent - received >= inflight x publishers (a
 * global cap that keeps the broker's queues bounded); in pub mode QoS 0 is bounded only by
 * TCP back-pressure (a publisher stops filling its buffer while 256 KiB wait to be written).
 * --rate R caps the total send rate (messages/s, 0 = as fast as allowed). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define WBUF_HIGH (256 * 1024) /* stop generating into a buffer holding this much */
#define READ_CHUNK (64 * 1024)
#define PER_TURN 256 /* PUBLISHes one publisher may generate per loop turn */
#define HEADER 16    /* monotonic ns + sequence number */
#define TS_FIELD 22  /* "TS:" + 19 digits */

enum role { SUB, PUB, IDLE };
enum state { CONNECTING, WAIT_CONNACK, WAIT_SUBACK, READY, DRAINING, CLOSED };

typedef struct {
  char *data;
  size_t len, off, cap;
} buf_t;

typedef struct conn {
  int fd, index, dirty, want_out;
  enum role role;
  enum state state;
  buf_t in, out;
  const char *topic; /* publish topic or subscription filter */
  double last_tx;    /* monotonic seconds of the last write, for PINGREQ */
  /* publisher */
  uint64_t seq_next, seq_end, acked;
  int inflight;
  uint16_t next_id;
  uint8_t *ids_used; /* 65536 bits: packet ids awaiting PUBACK */
  /* subscriber */
  uint64_t received, expected;
  uint8_t *seen; /* one bit per sequence number */
} conn_t;

static struct {
  const char *mode, *host, *port, *prefix, *client_prefix, *user, *password;
  const char *publish_topic, *subscribe_topic;
  int pairs, publishers, subscribers, qos, inflight, version, keepalive, connections, ramp;
  uint64_t messages, expect;
  size_t size;
  double timeout, hold, rate;
} opt = {
    .host = "127.0.0.1", .port = "1883", .prefix = "bench/", .pairs = 1, .publishers = -1,
    .subscribers = -1, .qos = 1, .inflight = 100, .version = 4, .keepalive = 60,
    .connections = 1000, .ramp = 200, .messages = 10000, .size = 100, .timeout = 60,
    .hold = 0, .rate = 0,
};

static int ep;
static conn_t *conns;
static int nconns;
static conn_t **dirty;
static int ndirty;
static uint64_t total_sent, total_acked, total_received, total_unique, total_dups;
static int64_t *latencies;
static uint64_t nlat, lat_cap;
static int64_t first_send_ns, last_send_ns, last_ack_ns, last_recv_ns, min_stamp_ns;
static int connected_count, failed_count, dropped_count, handshaking;
static int closing; /* set while disconnecting at the end: failures no longer matter */

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("mqttgen: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t real_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double now_s(void) { return mono_ns() / 1e9; }

static double cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p) die("out of memory");
  return p;
}

/* -- buffers and MQTT encoding ------------------------------------------------------------ */

static void reserve(buf_t *b, size_t extra) {
  if (b->len + extra <= b->cap) return;
  if (b->off) { /* compact first */
    memmove(b->data, b->data + b->off, b->len - b->off);
    b->len -= b->off;
    b->off = 0;
    if (b->len + extra <= b->cap) return;
  }
  size_t cap = b->cap ? b->cap : 4096;
  while (cap < b->len + extra) cap *= 2;
  b->data = realloc(b->data, cap);
  if (!b->data) die("out of memory");
  b->cap = cap;
}

static void mark_dirty(conn_t *c) {
  if (!c->dirty) {
    c->dirty = 1;
    dirty[ndirty++] = c;
  }
}

static uint8_t *put(conn_t *c, size_t n) {
  reserve(&c->out, n);
  uint8_t *p = (uint8_t *)c->out.data + c->out.len;
  c->out.len += n;
  mark_dirty(c);
  return p;
}

static size_t varint_len(size_t n) { return n < 128 ? 1 : n < 16384 ? 2 : n < 2097152 ? 3 : 4; }

static uint8_t *put_varint(uint8_t *p, size_t n) {
  do {
    uint8_t b = n % 128;
    n /= 128;
    *p++ = n ? b | 0x80 : b;
  } while (n);
  return p;
}

static uint8_t *put_u16(uint8_t *p, unsigned v) {
  *p++ = v >> 8;
  *p++ = v & 0xff;
  return p;
}

static uint8_t *put_str(uint8_t *p, const char *s, size_t n) {
  p = put_u16(p, n);
  memcpy(p, s, n);
  return p + n;
}

/* Fixed header + remaining length; returns where the variable header goes. */
static uint8_t *put_packet(conn_t *c, uint8_t type, size_t rem) {
  uint8_t *p = put(c, 1 + varint_len(rem) + rem);
  *p++ = type;
  return put_varint(p, rem);
}

static void send_connect(conn_t *c) {
  char id[128];
  const char *tag = c->role == SUB ? "s" : c->role == PUB ? "p" : "i";
  int idn = snprintf(id, sizeof id, "%s-%s%d", opt.client_prefix, tag, c->index);
  size_t ul = opt.user ? strlen(opt.user) : 0, pl = opt.password ? strlen(opt.password) : 0;
  size_t rem = 10 + (opt.version == 5) + 2 + idn + (opt.user ? 2 + ul : 0) +
               (opt.password ? 2 + pl : 0);
  uint8_t *p = put_packet(c, 0x10, rem);
  p = put_str(p, "MQTT", 4);
  *p++ = opt.version;
  *p++ = 0x02 | (opt.user ? 0x80 : 0) | (opt.password ? 0x40 : 0); /* clean session */
  p = put_u16(p, opt.keepalive);
  if (opt.version == 5) *p++ = 0; /* no properties */
  p = put_str(p, id, idn);
  if (opt.user) p = put_str(p, opt.user, ul);
  if (opt.password) put_str(p, opt.password, pl);
}

static void send_subscribe(conn_t *c) {
  size_t tl = strlen(c->topic);
  uint8_t *p = put_packet(c, 0x82, 2 + (opt.version == 5) + 2 + tl + 1);
  p = put_u16(p, 1);
  if (opt.version == 5) *p++ = 0;
  p = put_str(p, c->topic, tl);
  *p = opt.qos;
}

static void send_puback(conn_t *c, unsigned id) {
  uint8_t *p = put_packet(c, 0x40, 2);
  put_u16(p, id);
}

static void send_simple(conn_t *c, uint8_t type) { put_packet(c, type, 0); }

static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = v >> (8 * i);
}

static uint64_t get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static void put_digits(uint8_t *p, int64_t v) {
  for (int i = 18; i >= 0; i--, v /= 10) p[i] = '0' + v % 10;
}

static void send_publish(conn_t *c) {
  size_t tl = strlen(c->topic);
  size_t rem = 2 + tl + (opt.qos ? 2 : 0) + (opt.version == 5) + opt.size;
  uint8_t *p = put_packet(c, 0x30 | opt.qos << 1, rem);
  p = put_str(p, c->topic, tl);
  if (opt.qos) {
    while (c->ids_used[c->next_id >> 3] & (1 << (c->next_id & 7)) || c->next_id == 0)
      c->next_id++;
    c->ids_used[c->next_id >> 3] |= 1 << (c->next_id & 7);
    p = put_u16(p, c->next_id++);
    c->inflight++;
  }
  if (opt.version == 5) *p++ = 0;
  int64_t t = mono_ns();
  put_le64(p, t);
  put_le64(p + 8, c->seq_next++);
  if (opt.size >= HEADER + TS_FIELD) {
    memcpy(p + HEADER, "TS:", 3);
    put_digits(p + HEADER + 3, real_ns());
    memset(p + HEADER + TS_FIELD, 'x', opt.size - HEADER - TS_FIELD);
  } else {
    memset(p + HEADER, 'x', opt.size - HEADER);
  }
  if (!first_send_ns) first_send_ns = t;
  last_send_ns = t;
  total_sent++;
}

/* -- connections -------------------------------------------------------------------------- */

static struct addrinfo *target;

static void watch(conn_t *c, int out) {
  struct epoll_event ev = {.events = EPOLLIN | (out ? EPOLLOUT : 0), .data.ptr = c};
  if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev) < 0) die("epoll_ctl: %s", strerror(errno));
  c->want_out = out;
}

static void open_conn(conn_t *c) {
  c->fd = socket(target->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (c->fd < 0) die("socket: %s (connections open: %d)", strerror(errno), connected_count);
  int one = 1;
  setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(c->fd, target->ai_addr, target->ai_addrlen) < 0 && errno != EINPROGRESS)
    die("connect %s:%s: %s", opt.host, opt.port, strerror(errno));
  c->state = CONNECTING;
  struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
  if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) < 0) die("epoll_ctl: %s", strerror(errno));
  c->want_out = 1;
  handshaking++;
}

static void close_conn(conn_t *c) {
  if (c->state == CLOSED) return;
  if (c->state < READY) handshaking--;
  epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->state = CLOSED;
}

/* A connection that fails outside idle mode ends the run: the figures would be wrong. */
static void conn_failed(conn_t *c, const char *why) {
  if (closing) { /* the run is over: nothing to count */
    close_conn(c);
    return;
  }
  if (c->role != IDLE) die("connection %s%d: %s", c->role == SUB ? "sub" : "pub", c->index, why);
  if (c->state == READY) {
    dropped_count++;
    connected_count--;
  } else {
    failed_count++;
  }
  close_conn(c);
}

static void flush(conn_t *c) {
  c->dirty = 0;
  if (c->state == CLOSED || c->state == CONNECTING) return;
  buf_t *b = &c->out;
  while (b->off < b->len) {
    ssize_t n = send(c->fd, b->data + b->off, b->len - b->off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      conn_failed(c, strerror(errno));
      return;
    }
    b->off += n;
    c->last_tx = now_s();
  }
  if (b->off == b->len) b->off = b->len = 0;
  int pending = b->len > 0;
  if (pending != c->want_out) watch(c, pending);
}

/* -- incoming packets --------------------------------------------------------------------- */

static void record_latency(int64_t ns) {
  if (nlat == lat_cap) {
    lat_cap = lat_cap ? lat_cap * 2 : 65536;
    latencies = realloc(latencies, lat_cap * sizeof *latencies);
    if (!latencies) die("out of memory");
  }
  latencies[nlat++] = ns;
}

static void on_publish(conn_t *c, uint8_t flags, const uint8_t *p, size_t n) {
  int qos = (flags >> 1) & 3;
  if (n < 2) die("short PUBLISH");
  size_t tl = p[0] << 8 | p[1], at = 2 + tl;
  unsigned id = 0;
  if (qos) {
    if (at + 2 > n) die("short PUBLISH");
    id = p[at] << 8 | p[at + 1];
    at += 2;
  }
  if (opt.version == 5) {
    size_t plen = 0, mul = 1;
    do {
      if (at >= n) die("short PUBLISH properties");
      plen += (p[at] & 127) * mul;
      mul *= 128;
    } while (p[at++] & 128);
    at += plen;
  }
  if (at + HEADER > n) die("PUBLISH payload of %zu bytes has no stamp", n - at);
  int64_t now = mono_ns(), stamp = get_le64(p + at);
  uint64_t seq = get_le64(p + at + 8);
  if (qos) send_puback(c, id);
  if (seq >= opt.messages) die("sequence number %llu out of range", (unsigned long long)seq);
  total_received++;
  c->received++;
  if (c->seen[seq >> 3] & (1 << (seq & 7))) {
    total_dups++;
    return;
  }
  c->seen[seq >> 3] |= 1 << (seq & 7);
  total_unique++;
  if (!min_stamp_ns || stamp < min_stamp_ns) min_stamp_ns = stamp;
  last_recv_ns = now;
  record_latency(now - stamp);
}

static void on_puback(conn_t *c, const uint8_t *p, size_t n) {
  if (n < 2) die("short PUBACK");
  unsigned id = p[0] << 8 | p[1];
  if (n > 2 && p[2] >= 0x80) die("PUBACK reason code 0x%02x", p[2]);
  if (!(c->ids_used[id >> 3] & (1 << (id & 7)))) die("PUBACK for unknown packet id %u", id);
  c->ids_used[id >> 3] &= ~(1 << (id & 7));
  c->inflight--;
  c->acked++;
  total_acked++;
  last_ack_ns = mono_ns();
}

static void became_ready(conn_t *c) {
  c->state = READY;
  handshaking--;
  connected_count++;
}

static void on_packet(conn_t *c, uint8_t type, const uint8_t *p, size_t n) {
  switch (type >> 4) {
    case 2: /* CONNACK */
      if (c->state != WAIT_CONNACK || n < 2) die("unexpected CONNACK");
      if (p[1]) {
        char why[64];
        snprintf(why, sizeof why, "CONNACK refused, code 0x%02x", p[1]);
        conn_failed(c, why);
        return;
      }
      if (c->role == SUB) {
        c->state = WAIT_SUBACK;
        send_subscribe(c);
      } else {
        became_ready(c);
      }
      break;
    case 9: { /* SUBACK */
      size_t at = 2;
      if (opt.version == 5) {
        size_t plen = 0, mul = 1;
        do {
          if (at >= n) die("short SUBACK");
          plen += (p[at] & 127) * mul;
          mul *= 128;
        } while (p[at++] & 128);
        at += plen;
      }
      if (c->state != WAIT_SUBACK || at >= n) die("unexpected SUBACK");
      if (p[at] >= 0x80) die("subscription to %s refused, code 0x%02x", c->topic, p[at]);
      became_ready(c);
      break;
    }
    case 3:
      if (c->role != SUB) die("PUBLISH to a publisher connection");
      on_publish(c, type & 15, p, n);
      break;
    case 4:
      on_puback(c, p, n);
      break;
    case 13: /* PINGRESP */
      break;
    case 14:
      conn_failed(c, "broker sent DISCONNECT");
      break;
    default:
      die("unexpected packet type %d", type >> 4);
  }
}

static void on_readable(conn_t *c) {
  buf_t *b = &c->in;
  for (;;) {
    reserve(b, READ_CHUNK);
    ssize_t n = recv(c->fd, b->data + b->len, b->cap - b->len, 0);
    if (n == 0) {
      conn_failed(c, "connection closed by the broker");
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      conn_failed(c, strerror(errno));
      return;
    }
    b->len += n;
    /* parse every complete packet */
    while (b->len - b->off >= 2 && c->state != CLOSED) {
      const uint8_t *p = (uint8_t *)b->data + b->off;
      size_t avail = b->len - b->off, rem = 0, mul = 1, i = 1;
      int complete = 0;
      for (; i < avail && i <= 4; i++) {
        rem += (p[i] & 127) * mul;
        mul *= 128;
        if (!(p[i] & 128)) {
          complete = 1;
          break;
        }
      }
      if (!complete) {
        if (i > 4) die("malformed remaining length");
        break;
      }
      size_t head = i + 1;
      if (avail < head + rem) {
        reserve(b, head + rem - avail);
        break;
      }
      b->off += head + rem;
      on_packet(c, p[0], p + head, rem);
    }
    if (c->state == CLOSED) return;
    if (b->off == b->len) b->off = b->len = 0;
    if ((size_t)n < READ_CHUNK) break;
  }
}

static void on_event(conn_t *c, uint32_t events) {
  if (c->state == CLOSED) return;
  if (c->state == CONNECTING) {
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) {
      conn_failed(c, strerror(err));
      return;
    }
    if (!(events & EPOLLOUT)) return;
    c->state = WAIT_CONNACK;
    send_connect(c);
    return;
  }
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(c);
  if (c->state != CLOSED && events & EPOLLOUT) mark_dirty(c);
}

/* -- the loop ----------------------------------------------------------------------------- */

static conn_t *pubs, *subs;
static int npubs, nsubs;

static void poll_once(int timeout_ms) {
  struct epoll_event evs[512];
  int n = epoll_wait(ep, evs, 512, timeout_ms);
  if (n < 0 && errno != EINTR) die("epoll_wait: %s", strerror(errno));
  for (int i = 0; i < n; i++) {
    if (evs[i].data.ptr == NULL) continue; /* stdin: handled by the idle loop */
    on_event(evs[i].data.ptr, evs[i].events);
  }
}

static void flush_dirty(void) {
  for (int i = 0; i < ndirty; i++) flush(dirty[i]);
  ndirty = 0;
}

static void send_pings(double now) {
  for (int i = 0; i < nconns; i++) {
    conn_t *c = &conns[i];
    if (opt.keepalive && c->state == READY && now - c->last_tx > opt.keepalive * 0.75) {
      send_simple(c, 0xC0);
      c->last_tx = now;
    }
  }
}

/* How many messages publishers may still send now (rate and QoS 0 caps). */
static uint64_t allowance(double start) {
  uint64_t allow = UINT64_MAX;
  if (opt.rate > 0) {
    double due = (now_s() - start) * opt.rate + 1;
    allow = due > total_sent ? (uint64_t)due - total_sent : 0;
  }
  if (opt.qos == 0 && nsubs) {
    uint64_t copies = opt.expect / opt.messages ? opt.expect / opt.messages : 1;
    uint64_t cap = (uint64_t)opt.inflight * npubs, got = total_received / copies;
    uint64_t ahead = total_sent > got ? total_sent - got : 0, room = ahead >= cap ? 0 : cap - ahead;
    if (room < allow) allow = room;
  }
  return allow;
}

/* Fill publisher buffers; returns 1 when a publisher stopped only at its per-turn share
 * (so the loop should not sleep), 0 when all wait for acks, room or the clock. */
static int generate(double start) {
  uint64_t allow = allowance(start);
  int more = 0;
  for (int i = 0; i < npubs && allow; i++) {
    conn_t *c = &pubs[i];
    if (c->state != READY) continue;
    int k = 0;
    for (; k < PER_TURN && allow && c->seq_next < c->seq_end; k++) {
      if (opt.qos && c->inflight >= opt.inflight) break;
      if (c->out.len - c->out.off >= WBUF_HIGH) break;
      send_publish(c);
      allow--;
    }
    if (k == PER_TURN) more = 1;
  }
  return more;
}

static int publishers_done(void) {
  for (int i = 0; i < npubs; i++) {
    conn_t *c = &pubs[i];
    if (c->seq_next < c->seq_end || (opt.qos && c->inflight) || c->out.len > c->out.off)
      return 0;
  }
  return 1;
}

static int handshakes_pending(void) {
  for (int i = 0; i < nconns; i++)
    if (conns[i].state != READY) return 1;
  return 0;
}

static void ramp_up(double deadline) {
  int next = 0;
  double last_ping = now_s();
  while (next < nconns || handshaking > 0) {
    while (next < nconns && handshaking < opt.ramp) open_conn(&conns[next++]);
    double left = deadline - now_s();
    if (left <= 0) {
      if (opt.connections) break; /* idle: report what came up */
      die("timed out connecting (%d of %d up)", connected_count, nconns);
    }
    poll_once(left > 0.1 ? 100 : (int)(left * 1000) + 1);
    flush_dirty();
    if (now_s() - last_ping > 1) send_pings(last_ping = now_s());
  }
  if (!opt.connections && handshakes_pending()) die("a connection failed during setup");
}

static void hold_idle(double until) {
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
  int watching = epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev) == 0;
  if (!watching && !(opt.hold > 0)) die("cannot watch stdin and no --hold given");
  for (;;) {
    double left = until - now_s();
    if (opt.hold > 0 && left <= 0) break;
    struct epoll_event evs[512];
    int wait = opt.hold > 0 ? (int)(fmin(left, 1.0) * 1000) + 1 : 1000;
    int n = epoll_wait(ep, evs, 512, wait);
    if (n < 0 && errno != EINTR) die("epoll_wait: %s", strerror(errno));
    int stdin_closed = 0;
    for (int i = 0; i < n; i++) {
      if (evs[i].data.ptr == NULL) {
        char scratch[256];
        if (read(0, scratch, sizeof scratch) <= 0) stdin_closed = 1;
      } else {
        on_event(evs[i].data.ptr, evs[i].events);
      }
    }
    send_pings(now_s());
    flush_dirty();
    if (stdin_closed) break;
  }
}

/* DISCONNECT every ready connection, then wait (2 s at most) for the broker to close each:
 * closing a socket with unread input resets it, which could drop the last PUBLISHes. */
static void disconnect_all(void) {
  closing = 1;
  int open = 0;
  for (int i = 0; i < nconns; i++) {
    conn_t *c = &conns[i];
    if (c->state != READY) continue;
    send_simple(c, 0xE0);
    c->state = DRAINING;
    open++;
  }
  double deadline = now_s() + 2;
  while (open > 0 && now_s() < deadline) {
    for (int i = 0; i < ndirty; i++) {
      conn_t *c = dirty[i];
      flush(c);
      if (c->state == CLOSED)
        open--;
      else if (c->out.len == 0)
        shutdown(c->fd, SHUT_WR);
    }
    ndirty = 0;
    struct epoll_event evs[512];
    int n = epoll_wait(ep, evs, 512, 100);
    for (int i = 0; i < n; i++) {
      conn_t *c = evs[i].data.ptr;
      if (c == NULL || c->state != DRAINING) continue;
      if (evs[i].events & EPOLLOUT) mark_dirty(c);
      char scratch[4096];
      ssize_t got;
      while ((got = recv(c->fd, scratch, sizeof scratch, 0)) > 0) continue;
      if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
        close_conn(c);
        open--;
      }
    }
  }
  for (int i = 0; i < nconns; i++) close_conn(&conns[i]);
}

/* -- report ------------------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static double pct(double q) {
  if (!nlat) return 0;
  size_t i = (size_t)ceil(q * nlat) - 1;
  if (i >= nlat) i = nlat - 1;
  return latencies[i] / 1e6;
}

static void report(double cpu, double wall, int timed_out) {
  int has_sub = nsubs > 0, has_pub = npubs > 0;
  int64_t start = has_pub ? first_send_ns : min_stamp_ns;
  int64_t end = has_sub ? last_recv_ns : (opt.qos ? last_ack_ns : last_send_ns);
  double seconds = start && end > start ? (end - start) / 1e9 : 0;
  uint64_t counted = has_sub ? total_received : total_sent;
  uint64_t per = has_sub ? total_received : total_sent; /* fan-out: per delivery */
  double us_per_msg = per ? cpu * 1e6 / per : 0, cores = wall > 0 ? cpu / wall : 0;
  qsort(latencies, nlat, sizeof *latencies, cmp_i64);
  printf("{\"mode\": \"%s\", \"version\": %d, \"qos\": %d, \"size\": %zu, \"publishers\": %d, "
         "\"subscribers\": %d, \"inflight\": %d",
         opt.mode, opt.version, opt.qos, opt.size, npubs, nsubs, opt.inflight);
  if (has_pub) printf(", \"sent\": %llu, \"acked\": %llu", (unsigned long long)total_sent,
                      (unsigned long long)total_acked);
  if (has_sub) {
    printf(", \"expected\": %llu, \"received\": %llu, \"duplicates\": %llu, \"lost\": %llu",
           (unsigned long long)opt.expect, (unsigned long long)total_unique,
           (unsigned long long)total_dups, (unsigned long long)(opt.expect - total_unique));
    printf(", \"latency_ms\": {\"p50\": %.3f, \"p99\": %.3f, \"p999\": %.3f, \"max\": %.3f}",
           pct(0.5), pct(0.99), pct(0.999), pct(1.0));
  }
  printf(", \"seconds\": %.3f, \"msgs_per_s\": %.0f, \"client_cpu_us_per_msg\": %.2f, "
         "\"client_cores\": %.2f, \"capped\": %s, \"timed_out\": %s}\n",
         seconds, seconds > 0 ? counted / seconds : 0, us_per_msg, cores,
         cores >= 0.9 ? "true" : "false", timed_out ? "true" : "false");
}

/* -- setup -------------------------------------------------------------------------------- */

static void usage(void) {
  fputs("usage: mqttgen pubsub|pub|sub|idle [--host H] [--port P] [--pairs N]\n"
        "  [--publishers N] [--subscribers K] [--messages M] [--size S] [--qos 0|1]\n"
        "  [--inflight W] [--rate R] [--topic-prefix T] [--publish-topic T]\n"
        "  [--subscribe-topic F] [--expect E] [--version 4|5] [--client-prefix C]\n"
        "  [--user U --password P] [--timeout S] [--keepalive S] [--connections N]\n"
        "  [--ramp N] [--hold S]\n",
        stderr);
  exit(2);
}

static double number(const char *name, const char *s, double lo, double hi) {
  char *end;
  double v = strtod(s, &end);
  if (*s == 0 || *end || !(v >= lo && v <= hi)) die("--%s %s: expected a number in [%g, %g]", name, s, lo, hi);
  return v;
}

static void parse(int argc, char **argv) {
  static struct option longs[] = {
      {"host", 1, 0, 'h'},          {"port", 1, 0, 'p'},           {"pairs", 1, 0, 'n'},
      {"publishers", 1, 0, 'P'},    {"subscribers", 1, 0, 'K'},    {"messages", 1, 0, 'm'},
      {"size", 1, 0, 's'},          {"qos", 1, 0, 'q'},            {"inflight", 1, 0, 'w'},
      {"rate", 1, 0, 'r'},          {"topic-prefix", 1, 0, 't'},   {"publish-topic", 1, 0, 'T'},
      {"subscribe-topic", 1, 0, 'F'}, {"expect", 1, 0, 'e'},       {"version", 1, 0, 'v'},
      {"client-prefix", 1, 0, 'c'}, {"user", 1, 0, 'u'},           {"password", 1, 0, 'x'},
      {"timeout", 1, 0, 'o'},       {"keepalive", 1, 0, 'k'},      {"connections", 1, 0, 'C'},
      {"ramp", 1, 0, 'R'},          {"hold", 1, 0, 'H'},           {0, 0, 0, 0}};
  if (argc < 2) usage();
  opt.mode = argv[1];
  optind = 2;
  int c;
  double expect = -1;
  while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
    const char *name = longs[0].name;
    for (struct option *o = longs; o->name; o++)
      if (o->val == c) name = o->name;
    switch (c) {
      case 'h': opt.host = optarg; break;
      case 'p': opt.port = optarg; break;
      case 'n': opt.pairs = number(name, optarg, 1, 10000); break;
      case 'P': opt.publishers = number(name, optarg, 0, 10000); break;
      case 'K': opt.subscribers = number(name, optarg, 0, 10000); break;
      case 'm': opt.messages = number(name, optarg, 1, 1e10); break;
      case 's': opt.size = number(name, optarg, HEADER, 256e6); break;
      case 'q': opt.qos = number(name, optarg, 0, 1); break;
      case 'w': opt.inflight = number(name, optarg, 1, 65000); break;
      case 'r': opt.rate = number(name, optarg, 0, 1e9); break;
      case 't': opt.prefix = optarg; break;
      case 'T': opt.publish_topic = optarg; break;
      case 'F': opt.subscribe_topic = optarg; break;
      case 'e': expect = number(name, optarg, 0, 1e12); break;
      case 'v': opt.version = number(name, optarg, 4, 5); break;
      case 'c': opt.client_prefix = optarg; break;
      case 'u': opt.user = optarg; break;
      case 'x': opt.password = optarg; break;
      case 'o': opt.timeout = number(name, optarg, 0.001, 1e6); break;
      case 'k': opt.keepalive = number(name, optarg, 0, 65535); break;
      case 'C': opt.connections = number(name, optarg, 1, 1e6); break;
      case 'R': opt.ramp = number(name, optarg, 1, 1e5); break;
      case 'H': opt.hold = number(name, optarg, 0, 1e7); break;
      default: usage();
    }
  }
  if (optind != argc) usage();
  if (!opt.client_prefix) {
    static char prefix[32];
    snprintf(prefix, sizeof prefix, "mqttgen-%d", (int)getpid());
    opt.client_prefix = prefix;
  }
  int is_pubsub = !strcmp(opt.mode, "pubsub"), is_pub = !strcmp(opt.mode, "pub"),
      is_sub = !strcmp(opt.mode, "sub");
  if (!strcmp(opt.mode, "idle")) {
    nconns = opt.connections;
    return;
  }
  opt.connections = 0;
  if (!is_pubsub && !is_pub && !is_sub) usage();
  npubs = is_sub ? 0 : opt.publishers >= 0 ? opt.publishers : opt.pairs;
  nsubs = is_pub ? 0 : opt.subscribers >= 0 ? opt.subscribers : opt.pairs;
  if (is_pubsub && (!npubs || !nsubs)) die("pubsub needs publishers and subscribers");
  if (!npubs && !nsubs) die("nothing to do: no publishers, no subscribers");
  /* With a shared subscription filter every subscriber gets every message; otherwise
   * subscriber i gets publisher i's share. */
  opt.expect = expect >= 0       ? (uint64_t)expect
               : opt.subscribe_topic ? opt.messages * nsubs
                                 : opt.messages;
  if (is_pubsub && !opt.subscribe_topic && !opt.publish_topic && npubs != nsubs)
    die("with per-pair topics --publishers and --subscribers must be equal");
  if (opt.expect % opt.messages) die("--expect must be a multiple of --messages");
  nconns = npubs + nsubs;
}

static char *topic_for(const char *fixed, int i) {
  if (fixed) return strdup(fixed);
  char *t;
  if (asprintf(&t, "%s%d", opt.prefix, i) < 0) die("out of memory");
  return t;
}

int main(int argc, char **argv) {
  parse(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  int gai = getaddrinfo(opt.host, opt.port, &hints, &target);
  if (gai) die("%s:%s: %s", opt.host, opt.port, gai_strerror(gai));
  ep = epoll_create1(EPOLL_CLOEXEC);
  conns = xcalloc(nconns, sizeof *conns);
  dirty = xcalloc(nconns, sizeof *dirty);
  subs = conns;
  pubs = conns + nsubs;
  for (int i = 0; i < nconns; i++) conns[i].role = opt.connections ? IDLE : i < nsubs ? SUB : PUB;
  size_t seen_bytes = opt.messages / 8 + 1;
  for (int i = 0; i < nsubs; i++) {
    subs[i].index = i;
    subs[i].topic = topic_for(opt.subscribe_topic, i);
    subs[i].seen = xcalloc(seen_bytes, 1);
  }
  for (int i = 0; i < npubs; i++) { /* publisher i owns sequence numbers [start, end) */
    conn_t *c = &pubs[i];
    c->index = i;
    c->topic = topic_for(opt.publish_topic, i);
    c->seq_next = opt.messages * i / npubs;
    c->seq_end = opt.messages * (i + 1) / npubs;
    c->ids_used = xcalloc(8192, 1);
    c->next_id = 1;
  }
  for (int i = 0; i < nconns; i++) conns[i].index = conns[i].role == IDLE ? i : conns[i].index;

  double t0 = now_s(), deadline = t0 + opt.timeout;
  ramp_up(deadline);
  if (opt.connections) { /* idle */
    double up = now_s() - t0;
    printf("{\"connected\": %d, \"failed\": %d, \"seconds\": %.3f}\n", connected_count,
           failed_count, up);
    fflush(stdout);
    double h0 = now_s();
    hold_idle(h0 + opt.hold);
    int held = connected_count;
    disconnect_all();
    printf("{\"connected\": %d, \"failed\": %d, \"seconds\": %.3f, \"held\": %d, "
           "\"dropped\": %d, \"held_seconds\": %.3f}\n",
           held + dropped_count, failed_count, up, held, dropped_count, now_s() - h0);
    return 0;
  }

  if (!npubs) { /* sub: say when subscribed, so that a publisher can be started then */
    printf("{\"subscribed\": %d, \"seconds\": %.3f}\n", connected_count, now_s() - t0);
    fflush(stdout);
  }
  double cpu0 = cpu_s(), start = now_s();
  int timed_out = 0;
  double last_ping = start;
  for (;;) {
    int more = generate(start);
    flush_dirty();
    int subs_done = total_unique >= opt.expect || !nsubs;
    if (subs_done && (nsubs || publishers_done())) break;
    double now = now_s();
    if (now >= deadline) {
      timed_out = 1;
      break;
    }
    if (now - last_ping > 1) send_pings(last_ping = now);
    int wait = more ? 0 : 10;
    if (opt.rate > 0 && !more) wait = 1; /* the next paced message is due within ~1 ms */
    poll_once(wait);
  }
  double cpu = cpu_s() - cpu0, wall = now_s() - start;
  disconnect_all();
  report(cpu, wall, timed_out);
  return 0;
}
