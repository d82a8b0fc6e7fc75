'use strict';
// A progressive lease from Node.js, against a live prefill server: open it with the first
// chunk, claim it as a decode server would, wait for the next commit while the engine
// commits it, then the final commit and the consumed claim. Prints one JSON summary line.
//   node examples/progressive.js PREFILL_ADDR

const crypto = require('crypto');
const { KvsvcClient, REASONS, blocks } = require('..');

async function main() {
  const [pAddr] = process.argv.slice(2);
  const p = new KvsvcClient(pAddr);
  try {
    const pub = await p.publishBlocks({ request_id: 'node-grow', block_ids_per_group: blocks([1, 2]), num_tokens: 8, progressive: true });
    const params = pub.params;
    const claimId = crypto.randomBytes(16).toString('hex');
    const lease = { request_id: 'node-grow', lease_epoch: params.remote_epoch, engine_id: 'node-d' };
    await p.claimLease({ ...lease, tp_size: 1, lease_token: params.lease_token, claim_id: claimId });
    // Held on P until the engine's next commit (reaching P before or after it, the answer is the same).
    const waited = p.waitCommit({ ...lease, claim_id: claimId, after_epoch: 1, wait_ms: 30000 }, { timeoutMs: 60000 });
    const commit = { request_id: 'node-grow', lease_token: params.lease_token };
    await p.commitBlocks({ ...commit, commit_epoch: 2, block_ids_per_group: blocks([5]), num_tokens: 12 });
    const next = await waited;
    let outOfOrder = null;
    try {
      await p.commitBlocks({ ...commit, commit_epoch: 4, block_ids_per_group: blocks([6]), num_tokens: 16 });
    } catch (err) {
      outOfOrder = { code: err.code, reason: err.reason, typed: err.reason === REASONS.COMMIT_OUT_OF_ORDER };
    }
    const last = await p.commitBlocks({ ...commit, commit_epoch: 3, block_ids_per_group: blocks([6]), num_tokens: 16, final: true });
    const tail = await p.waitCommit({ ...lease, claim_id: claimId, after_epoch: 2, wait_ms: 0 });
    console.log(JSON.stringify({
      progressive: params.progressive, next_epoch: next.commit_epoch, next_blocks: next.block_ids_per_group.map((g) => g.block_ids),
      out_of_order: outOfOrder, final_epoch: last.commit_epoch, tail_final: tail.final,
      tail_blocks: tail.block_ids_per_group.map((g) => g.block_ids),
      lease_token: params.lease_token, lease_epoch: String(params.remote_epoch), claim_id: claimId,
    }));
  } finally {
    p.close();
  }
}

main().catch((err) => { console.error(err); process.exit(1); });
