'use strict';
// Node.js client of kvsvc.v1. Loads kv_transfer.proto at runtime (uint64 as strings, enums
// as strings, field names as in the .proto), turns google.rpc.Status error details into
// KvsvcError {code, reason, metadata}, and retries idempotent calls that never reached a
// server. The .proto is the repository's protos/ when used from a checkout, and the copy
// `npm pack` puts into the package (proto/, see package.json) once installed elsewhere.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const fs = require('fs');

const PACKED = path.resolve(__dirname, 'proto');
const PROTO_ROOT = process.env.KVSVC_PROTO_ROOT
  || (fs.existsSync(PACKED) ? PACKED : path.resolve(__dirname, '..', '..', 'protos'));
const PROTO_FILE = 'kvsvc/v1/kv_transfer.proto';

const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_ROOT] };

// The few google.rpc messages an error carries, declared here so no extra .proto is needed.
const rpcTypes = protobuf.Root.fromJSON({
  nested: {
    google: { nested: {
      protobuf: { nested: { Any: { fields: { type_url: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } } } },
      rpc: { nested: {
        Status: { fields: { code: { type: 'int32', id: 1 }, message: { type: 'string', id: 2 },
                            details: { rule: 'repeated', type: 'google.protobuf.Any', id: 3 } } },
        ErrorInfo: { fields: { reason: { type: 'string', id: 1 }, domain: { type: 'string', id: 2 },
                               metadata: { keyType: 'string', type: 'string', id: 3 } } },
        BadRequest: { fields: { field_violations: { rule: 'repeated', type: 'FieldViolation', id: 1 } },
                      nested: { FieldViolation: { fields: { field: { type: 'string', id: 1 }, description: { type: 'string', id: 2 } } } } },
      } },
    } },
  },
});
const Status = rpcTypes.lookupType('google.rpc.Status');
const ErrorInfo = rpcTypes.lookupType('google.rpc.ErrorInfo');
const BadRequest = rpcTypes.lookupType('google.rpc.BadRequest');

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, value]) => [value, name]));

class KvsvcError extends Error {
  constructor(code, reason, message, metadata, fieldViolations) {
    super(`${reason}: ${message}`);
    this.name = 'KvsvcError';
    this.code = code;                 // e.g. 'FAILED_PRECONDITION'
    this.reason = reason;             // e.g. 'LEASE_EXPIRED'
    this.metadata = metadata || {};   // the offending values
    this.fieldViolations = fieldViolations || [];
  }
}

function toKvsvcError(err) {
  const raw = err.metadata && err.metadata.get('grpc-status-details-bin');
  return fromStatus(CODE_NAMES[err.code] || 'UNKNOWN', err.details || err.message, raw && raw.length ? raw[0] : null);
}

// The KvsvcError of a serialized google.rpc.Status (a call's grpc-status-details-bin, or a
// TransferStream answer's error_status).
function fromStatus(fallbackCode, fallbackMessage, raw) {
  let code = fallbackCode;
  let reason = code;
  let metadata = {};
  let violations = [];
  let message = fallbackMessage;
  if (raw) {
    const status = Status.decode(raw);
    if (status.code in CODE_NAMES) code = CODE_NAMES[status.code];
    reason = code;
    message = status.message || message;
    for (const any of status.details) {
      if (any.type_url.endsWith('/google.rpc.ErrorInfo')) {
        const info = ErrorInfo.decode(any.value);
        reason = info.reason;
        metadata = { ...info.metadata };
      } else if (any.type_url.endsWith('/google.rpc.BadRequest')) {
        violations = BadRequest.decode(any.value).field_violations.map((v) => ({ field: v.field, description: v.description }));
      }
    }
  }
  if (message && message.startsWith(`${reason}: `)) message = message.slice(reason.length + 2);
  return new KvsvcError(code, reason, message, metadata, violations);
}

function loadService() {
  const def = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
  return grpc.loadPackageDefinition(def).kvsvc.v1.KvTransferService;
}

// Every reason kvsvc's errors carry: the .proto's ErrorReason values without their
// ERROR_REASON_ prefix, name -> name, so callers write err.reason === REASONS.LEASE_EXPIRED
// (a misspelt reason is undefined, not a comparison that is never true).
function loadReasons() {
  const def = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
  const names = def['kvsvc.v1.ErrorReason'].type.value.map((v) => v.name.replace(/^ERROR_REASON_/, ''));
  return Object.freeze(Object.fromEntries(names.filter((n) => n !== 'UNSPECIFIED').map((n) => [n, n])));
}
const REASONS = loadReasons();

const UNARY = {
  getInfo: 'GetInfo', handshake: 'Handshake', publishBlocks: 'PublishBlocks', claimLease: 'ClaimLease',
  planTransfer: 'PlanTransfer', transfer: 'Transfer', notify: 'Notify', waitTransfer: 'WaitTransfer',
  listLeases: 'ListLeases', commitBlocks: 'CommitBlocks', waitCommit: 'WaitCommit',
};
// Safe to send twice: a Transfer joins its running job by request id, a claim with the
// same claim id is granted again, a notification is applied once, a commit sent again
// with its epoch and blocks is answered as the first. PublishBlocks is not (a second call
// would lease the blocks again), so it is never retried.
const IDEMPOTENT = new Set(['GetInfo', 'Handshake', 'ClaimLease', 'PlanTransfer', 'Transfer', 'Notify', 'WaitTransfer',
  'ListLeases', 'CommitBlocks', 'WaitCommit']);

// UNAVAILABLE with no kvsvc ErrorInfo: the call never reached a kvsvc server (connection
// refused, reset before an answer); a server's own UNAVAILABLE answer carries a reason.
function neverReached(err) {
  const details = err.metadata && err.metadata.get('grpc-status-details-bin');
  return err.code === grpc.status.UNAVAILABLE && !(details && details.length);
}

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

class KvsvcClient {
  // retries: extra attempts of an idempotent call that never reached the server, backoffMs
  // apart (doubling, jittered), all within the call's own deadline; onRetry(rpc, attempt, err)
  // is called before each.
  constructor(address, { timeoutMs = 30000, credentials, retries = 2, backoffMs = 100, onRetry } = {}) {
    const Service = loadService();
    this.raw = new Service(address, credentials || grpc.credentials.createInsecure());
    this.timeoutMs = timeoutMs;
    this.retries = retries;
    this.backoffMs = backoffMs;
    this.onRetry = onRetry;
    for (const [method, rpc] of Object.entries(UNARY)) {
      this[method] = (request = {}, { timeoutMs: t } = {}) => this._unary(rpc, request, t);
    }
  }

  async _unary(rpc, request, timeoutMs) {
    const end = Date.now() + (timeoutMs || this.timeoutMs);
    const attempts = IDEMPOTENT.has(rpc) ? this.retries + 1 : 1;
    let delay = this.backoffMs;
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this._once(rpc, request, new Date(end));
      } catch (err) {
        const wait = delay * (0.5 + Math.random());
        if (attempt >= attempts || !neverReached(err) || Date.now() + wait >= end) throw toKvsvcError(err);
        if (this.onRetry) this.onRetry(rpc, attempt, toKvsvcError(err));
        await sleep(wait);
        delay *= 2;
      }
    }
  }

  _once(rpc, request, deadline) {
    return new Promise((resolve, reject) => {
      this.raw[rpc](request, { deadline }, (err, response) => (err ? reject(err) : resolve(response)));
    });
  }

  // Async iterator over released requests; call .cancel() on the returned stream to stop.
  watchReleases() {
    const call = this.raw.WatchReleases({});
    const iterator = (async function* iterate() {
      try {
        for await (const event of call) yield event;
      } catch (err) {
        if (err.code !== grpc.status.CANCELLED) throw toKvsvcError(err);
      }
    })();
    iterator.cancel = () => call.cancel();
    return iterator;
  }

  // Transfers as messages on one TransferStream (what an engine that runs many uses):
  // .transfer(request, {timeoutMs}) as the unary call, .close() when done.
  transferStream() { return new TransferChannel(this); }

  close() { this.raw.close(); }
}

// Answers are matched to transfers by request_id. A transfer whose deadline passes is given
// up on the server too (cancel_request_ids); a stream that breaks fails its waiting
// transfers with UNAVAILABLE (their outcome unknown: ask waitTransfer before reusing the
// blocks) and the next transfer opens a new one. A request id already waiting here, and
// every transfer to a server without TransferStream, go as unary calls.
class TransferChannel {
  constructor(client) {
    this.client = client;
    this.call = null;
    this.pending = new Map();
    this.unary = false;
  }

  transfer(request, { timeoutMs } = {}) {
    const t = timeoutMs || this.client.timeoutMs;
    if (this.unary || this.pending.has(request.request_id)) return this.client.transfer(request, { timeoutMs: t });
    return new Promise((resolve, reject) => {
      const call = this._open();
      const id = request.request_id;
      const timer = setTimeout(() => {
        this.pending.delete(id);
        if (this.call === call) call.write({ cancel_request_ids: [id] });
        reject(new KvsvcError('DEADLINE_EXCEEDED', 'DEADLINE_EXCEEDED', `no answer for ${id} within ${t} ms`));
      }, t);
      this.pending.set(id, { resolve, reject, timer, request, timeoutMs: t });
      call.write({ transfers: [{ request, timeout_ms: t }] });
    });
  }

  _open() {
    if (this.call) return this.call;
    const call = this.client.raw.TransferStream();
    call.on('data', (resp) => {
      for (const answer of resp.answers) {
        const waiting = this.pending.get(answer.request_id);
        if (!waiting) continue;
        this.pending.delete(answer.request_id);
        clearTimeout(waiting.timer);
        if (answer.result === 'response') waiting.resolve(answer.response);
        else waiting.reject(fromStatus('UNKNOWN', 'the transfer failed', answer.error_status));
      }
    });
    const ended = (err) => {
      if (this.call !== call) return;
      this.call = null;
      const waiting = [...this.pending.values()];
      this.pending.clear();
      const error = err ? toKvsvcError(err) : null;
      for (const w of waiting) {
        clearTimeout(w.timer);
        if (error && error.code === 'UNIMPLEMENTED') {
          this.unary = true;
          this.client.transfer(w.request, { timeoutMs: w.timeoutMs }).then(w.resolve, w.reject);
        } else if (error && error.reason !== 'UNAVAILABLE' && error.reason !== 'CANCELLED') {
          w.reject(error); // the server's own end of the stream (SHUTTING_DOWN, NOT_AN_ENGINE, ...)
        } else {
          w.reject(new KvsvcError('UNAVAILABLE', 'UNAVAILABLE',
            `the TransferStream broke before the answer to ${w.request.request_id}`));
        }
      }
      if (error && error.code === 'UNIMPLEMENTED') this.unary = true;
    };
    call.on('error', ended);
    call.on('end', () => ended(null));
    this.call = call;
    return call;
  }

  close() {
    const call = this.call;
    if (!call) return;
    call.end();
    call.cancel();
  }
}

const blocks = (...groups) => groups.map((ids) => ({ block_ids: ids }));

module.exports = { KvsvcClient, TransferChannel, KvsvcError, toKvsvcError, blocks, loadService, REASONS, PROTO_ROOT };
