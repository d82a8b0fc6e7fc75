'use strict';
// Drive a live prefill/decode server pair from Node.js: GetInfo, PublishBlocks,
// PlanTransfer, Transfer, WaitTransfer, then a LEASE_EXPIRED case, then transfers on a
// TransferStream. Prints one JSON summary line.
//   node examples/transfer.js PREFILL_ADDR DECODE_ADDR P_BLOCKS D_BLOCKS   (blocks comma-separated)

const { KvsvcClient, REASONS, blocks } = require('..');

async function main() {
  const [pAddr, dAddr, pIds = '1,2,3', dIds = '4,5,6'] = process.argv.slice(2);
  const p = new KvsvcClient(pAddr);
  const d = new KvsvcClient(dAddr);
  const pBlocks = pIds.split(',').map(Number);
  const dBlocks = dIds.split(',').map(Number);
  try {
    const [pInfo, dInfo] = [await p.getInfo(), await d.getInfo()];
    const pub = await p.publishBlocks({ request_id: 'node-req-1', block_ids_per_group: blocks(pBlocks) });
    const plan = await d.planTransfer({
      remote_address: pAddr, local_block_ids_per_group: blocks(dBlocks),
      remote_block_ids_per_group: blocks(pBlocks), summary_only: true,
    });
    const result = await d.transfer({ request_id: 'node-d-1', params: pub.params, local_block_ids_per_group: blocks(dBlocks) });
    const settled = await d.waitTransfer({ request_id: 'node-d-1' });
    let expired = null;
    try {
      await d.transfer({ request_id: 'node-d-2', params: pub.params, local_block_ids_per_group: blocks(dBlocks) });
    } catch (err) {
      // The lease was consumed by the first transfer: a typed answer, not a bare failure.
      expired = { code: err.code, reason: err.reason, metadata: err.metadata, is_lease_expired: err.reason === REASONS.LEASE_EXPIRED };
    }
    // Two more on one TransferStream, and a third whose lease was consumed already: its own error.
    const channel = d.transferStream();
    const pubs = [await p.publishBlocks({ request_id: 'node-req-2', block_ids_per_group: blocks(pBlocks) }),
      await p.publishBlocks({ request_id: 'node-req-3', block_ids_per_group: blocks(pBlocks) })];
    const onStream = await Promise.allSettled([
      channel.transfer({ request_id: 'node-s-2', params: pubs[0].params, local_block_ids_per_group: blocks(dBlocks) }),
      channel.transfer({ request_id: 'node-s-3', params: pubs[1].params, local_block_ids_per_group: blocks(dBlocks) }),
      channel.transfer({ request_id: 'node-s-4', params: pub.params, local_block_ids_per_group: blocks(dBlocks) }),
    ]);
    channel.close();
    console.log(JSON.stringify({
      stream: onStream.map((r) => (r.status === 'fulfilled' ? { total_bytes: r.value.total_bytes }
        : { code: r.reason.code, reason: r.reason.reason })),
      prefill: { engine_id: pInfo.engine_id, tp_size: pInfo.tp_size, epoch: pInfo.epoch },
      decode: { engine_id: dInfo.engine_id, tp_size: dInfo.tp_size },
      lease_epoch: pub.params.remote_epoch,
      plan: { total_bytes: plan.total_bytes, total_descriptors: plan.total_descriptors,
              sources: plan.rank_plans.map((r) => r.source_ranks) },
      transfer: { total_bytes: result.total_bytes, ranks: result.ranks.map((r) => r.local_rank) },
      settled: settled.state,
      second_transfer_error: expired,
    }));
  } finally {
    p.close();
    d.close();
  }
}

main().catch((err) => {
  console.error(`kvsvc node example failed: ${err.code || ''} ${err.reason || ''} ${err.message}`);
  process.exit(1);
});
