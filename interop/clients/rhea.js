// rhea (npm) AMQP 1.0 driver: argv[2] is the JSON action; prints JSON lines (see common.py).
"use strict";
const rhea = require("rhea");

const a = JSON.parse(process.argv[2]);
const emit = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const b64 = (buf) => Buffer.from(buf).toString("base64");
const PROPS = ["correlation_id", "reply_to", "content_type", "group_id", "subject"];

function toMessage(m) {
  const out = { body: rhea.message.data_section(Buffer.from(m.body, "base64")), durable: true };
  for (const [k, v] of Object.entries(m.properties || {})) {
    out[k] = v && v.binary ? Buffer.from(v.binary, "base64") : v;
  }
  if (m.application_properties) out.application_properties = m.application_properties;
  return out;
}

function toJson(msg) {
  const body = msg.body;
  const isData = body && body.typecode === 0x75;
  const raw = isData ? body.content : Buffer.isBuffer(body) ? body : Buffer.from(String(body));
  const props = {};
  for (const k of PROPS) {
    const v = msg[k];
    if (v === undefined || v === null) continue;
    props[k] = Buffer.isBuffer(v) ? { binary: b64(v) } : String(v);
  }
  return { body: b64(raw), body_kind: isData ? "data" : typeof body, properties: props,
    application_properties: msg.application_properties || {}, durable: !!msg.durable };
}

const container = rhea.create_container({ id: a.client_id });
const options = { host: a.host, port: a.port, reconnect: false };
if (a.username) Object.assign(options, { username: a.username, password: a.password });
if (a.ca) Object.assign(options, { transport: "tls", ca: [require("fs").readFileSync(a.ca)] });
const timer = setTimeout(() => done({ ok: a.action === "receive", messages: got }),
  a.timeout * 1000);
const got = [];
let conn;

function done(result) {
  clearTimeout(timer);
  emit(result);
  if (conn) conn.close();
  setTimeout(() => process.exit(0), 100);
}

container.on("connection_error", (ctx) => done({ ok: false, error: String(ctx.connection.error && ctx.connection.error.condition || "connection_error") }));
container.on("disconnected", (ctx) => {
  if (!ctx.connection.is_open() && a.action === "connect") {
    done({ ok: false, error: String(ctx.error || "disconnected") });
  }
});
container.on("error", (ctx) => done({ ok: false, error: String(ctx.error) }));

const settle = a.settle === "presettled" ? { snd_settle_mode: 1 } : { snd_settle_mode: 0 };
container.on("connection_open", (ctx) => {
  if (a.action === "connect") done({ ok: true });
  else if (a.action === "send") {
    const sender = ctx.connection.open_sender({ target: a.address, ...settle });
    let sent = 0;
    let settled = 0;
    sender.on("sendable", () => {
      while (sender.sendable() && sent < a.messages.length) {
        sender.send(toMessage(a.messages[sent++]));
        if (a.settle === "presettled" && sent === a.messages.length) done({ ok: true });
      }
    });
    sender.on("accepted", () => { if (++settled === a.messages.length) done({ ok: true }); });
    sender.on("rejected", (c) => done({ ok: false, error: JSON.stringify(c.delivery.remote_state) }));
    sender.on("released", () => done({ ok: false, error: "released" }));
  } else if (a.action === "receive") {
    const receiver = ctx.connection.open_receiver({ source: a.address, credit_window: a.count,
      autoaccept: a.settle !== "presettled", ...settle });
    receiver.on("receiver_open", () => emit({ event: "ready" }));
    receiver.on("message", (c) => {
      got.push(toJson(c.message));
      if (got.length >= a.count) setTimeout(() => done({ ok: true, messages: got }), 100);
    });
  } else if (a.action === "request") {
    const receiver = ctx.connection.open_receiver({ source: { dynamic: true } });
    receiver.on("receiver_open", (c) => {
      const replyTo = c.receiver.source.address;
      const sender = ctx.connection.open_sender(a.address);
      const msg = toMessage(a.message);
      msg.reply_to = replyTo;
      sender.once("sendable", () => sender.send(msg));
      receiver.on("message", (m) => done({ ok: true, reply_to: replyTo, reply: toJson(m.message) }));
    });
  }
});
conn = container.connect(options);
