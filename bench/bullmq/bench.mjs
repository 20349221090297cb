// The BullMQ side of `bench_queue` (bench/src/bin/bench_queue.rs runs it and compares): the
// same Redis, the same job count and concurrency, one queue under a fresh prefix, obliterated at
// the end.
//
//     REDIS_URL=redis://127.0.0.1:56379/0 JOBS=50000 CONCURRENCY=100 PREFIX=bench:<uuid> \
//         node bench/bullmq/bench.mjs
//
// SAMPLE (default JOBS / 5) is how many jobs are prioritised, and how many others cancelled.
// Phases, in this order (each job's data is one UUID, `{ taskId }`, the nearest thing to our
// queue's member, a task id; jobs are removed on completion so memory stays flat):
//   1. enqueue_bulk: JOBS plain jobs with `addBulk`, batches of 1000, one batch at a time
//      (latency per batch);
//   2. process: a Worker with concurrency CONCURRENCY and a no-op processor drains them (jobs/s
//      from the first completion to the last; latency per job from the processor's start to the
//      'completed' event, i.e. the moveToFinished round trip, which also fetches that slot's next
//      job);
//   3. enqueue: JOBS jobs one `add` at a time by CONCURRENCY concurrent producers, each with a
//      priority (10), so that they live in BullMQ's prioritized sorted set where changePriority
//      and remove are O(log n) (on the plain wait list both do an LREM, O(n));
//   4. prioritise: `job.changePriority({ priority: 1 })` of SAMPLE random waiting jobs;
//   5. cancel: `job.remove()` of SAMPLE other random waiting jobs;
//   (4 and 5 by CONCURRENCY concurrent callers), then `queue.obliterate({ force: true })`.
// Prints one JSON object on stdout; progress goes to stderr.

import { randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';

import { Queue, Worker } from 'bullmq';
import IORedis from 'ioredis';

const BATCH = 1000;
const QUEUED_PRIORITY = 10;
const RAISED_PRIORITY = 1;

function integer(name, fallback) {
  const text = process.env[name];
  if (text === undefined || text === '') return fallback;
  const value = Number(text);
  if (!Number.isInteger(value) || value < 1) {
    throw new Error(`${name} must be a positive integer, not ${JSON.stringify(text)}`);
  }
  return value;
}

function version(name) {
  const url = new URL(`./node_modules/${name}/package.json`, import.meta.url);
  return JSON.parse(readFileSync(url, 'utf8')).version;
}

function log(message) {
  process.stderr.write(`[bullmq] ${message}\n`);
}

/** p50/p99/max of latencies in ms (nearest rank on the sorted samples, as bench_queue does). */
function percentiles(samples) {
  const sorted = Float64Array.from(samples).sort();
  const at = p => (sorted.length === 0 ? 0 : sorted[Math.round((sorted.length - 1) * p)]);
  return { p50_ms: at(0.5), p99_ms: at(0.99), max_ms: at(1) };
}

/** Run `operation(item)` over `items` with `concurrency` concurrent callers; latency per call. */
async function concurrently(items, concurrency, operation) {
  const latencies = new Array(items.length);
  let next = 0;
  const caller = async () => {
    for (;;) {
      const index = next++;
      if (index >= items.length) return;
      const begun = performance.now();
      await operation(items[index], index);
      latencies[index] = performance.now() - begun;
    }
  };
  const started = performance.now();
  await Promise.all(Array.from({ length: Math.min(concurrency, items.length) }, caller));
  const seconds = (performance.now() - started) / 1000;
  return {
    count: items.length,
    seconds,
    per_second: items.length / seconds,
    ...percentiles(latencies),
  };
}

function shuffle(array) {
  for (let i = array.length - 1; i > 0; i--) {
    const j = Math.floor(Math.random() * (i + 1));
    [array[i], array[j]] = [array[j], array[i]];
  }
  return array;
}

async function main() {
  const url = process.env.REDIS_URL || 'redis://127.0.0.1:56379/0';
  const jobs = integer('JOBS', 50_000);
  const concurrency = integer('CONCURRENCY', 100);
  const sample = integer('SAMPLE', Math.max(1, Math.floor(jobs / 5)));
  if (2 * sample > jobs) throw new Error('SAMPLE must be at most JOBS / 2');
  const prefix = process.env.PREFIX || `bench:${randomUUID()}`;
  const name = 'tasks';

  // BullMQ's workers need maxRetriesPerRequest: null; the queue gets its own connection.
  const queueConnection = new IORedis(url, { maxRetriesPerRequest: null });
  const workerConnection = new IORedis(url, { maxRetriesPerRequest: null });
  const queue = new Queue(name, {
    connection: queueConnection,
    prefix,
    defaultJobOptions: { removeOnComplete: true, removeOnFail: true },
  });
  queue.on('error', error => log(`queue error: ${error}`));
  await queue.waitUntilReady();

  const result = {
    bullmq_version: version('bullmq'),
    ioredis_version: version('ioredis'),
    node_version: process.version,
    jobs,
    concurrency,
    sample,
  };
  try {
    // 1. addBulk, one batch of 1000 at a time.
    const data = Array.from({ length: jobs }, () => ({ taskId: randomUUID() }));
    log(`enqueue_bulk: ${jobs} jobs in batches of ${BATCH}`);
    const batches = [];
    for (let start = 0; start < jobs; start += BATCH) {
      batches.push(data.slice(start, start + BATCH).map(item => ({ name: 'task', data: item })));
    }
    const bulk = await concurrently(batches, 1, batch => queue.addBulk(batch));
    result.enqueue_bulk = {
      ...bulk,
      count: jobs,
      per_second: jobs / bulk.seconds,
      batch: BATCH,
      latency: 'per addBulk call of one batch',
    };

    // 2. A worker drains them.
    log(`process: ${jobs} jobs, worker concurrency ${concurrency}`);
    const latencies = [];
    const begunAt = new Map();
    let first;
    let last;
    let finished;
    const allDone = new Promise(resolve => {
      finished = resolve;
    });
    const worker = new Worker(
      name,
      async job => {
        begunAt.set(job.id, performance.now());
      },
      { connection: workerConnection, prefix, concurrency, autorun: false },
    );
    worker.on('error', error => log(`worker error: ${error}`));
    worker.on('failed', (job, error) => log(`job ${job?.id} failed: ${error}`));
    worker.on('completed', job => {
      const now = performance.now();
      latencies.push(now - begunAt.get(job.id));
      begunAt.delete(job.id);
      first ??= now;
      last = now;
      if (latencies.length === jobs) finished();
    });
    const workerStarted = performance.now();
    const running = worker.run();
    await allDone;
    await worker.close();
    await running;
    result.process = {
      count: jobs,
      seconds: (last - first) / 1000,
      per_second: (jobs - 1) / ((last - first) / 1000),
      wall_seconds: (last - workerStarted) / 1000,
      wall_per_second: jobs / ((last - workerStarted) / 1000),
      ...percentiles(latencies),
      latency: "processor start -> 'completed' event (moveToFinished, which fetches the next job)",
    };

    // 3. One add at a time, CONCURRENCY producers, with a priority.
    log(`enqueue: ${jobs} jobs one add at a time, ${concurrency} producers`);
    const more = Array.from({ length: jobs }, () => ({ taskId: randomUUID() }));
    const added = new Array(jobs);
    result.enqueue = {
      ...(await concurrently(more, concurrency, async (item, index) => {
        added[index] = await queue.add('task', item, { priority: QUEUED_PRIORITY });
      })),
      priority: QUEUED_PRIORITY,
      latency: 'per add',
    };

    // 4 and 5. Disjoint random samples of the waiting jobs.
    const order = shuffle(added.slice());
    const toPrioritise = order.slice(0, sample);
    const toCancel = order.slice(sample, 2 * sample);
    log(`prioritise: ${sample} changePriority calls`);
    result.prioritise = {
      ...(await concurrently(toPrioritise, concurrency, job =>
        job.changePriority({ priority: RAISED_PRIORITY }),
      )),
      latency: 'per changePriority',
    };
    log(`cancel: ${sample} remove calls`);
    result.cancel = {
      ...(await concurrently(toCancel, concurrency, job => job.remove())),
      latency: 'per remove',
    };
    const waiting = await queue.getPrioritizedCount();
    result.waiting_after_cancel = waiting;
    if (waiting !== jobs - sample) {
      throw new Error(`expected ${jobs - sample} waiting jobs after the cancels, found ${waiting}`);
    }
  } finally {
    await queue.obliterate({ force: true });
    // Whatever obliterate leaves (it keeps nothing it knows of): count and delete it.
    let cursor = '0';
    let left = 0;
    do {
      let keys;
      [cursor, keys] = await queueConnection.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000);
      if (keys.length > 0) {
        left += keys.length;
        await queueConnection.del(...keys);
      }
    } while (cursor !== '0');
    result.keys_left_after_obliterate = left;
    await queue.close();
    queueConnection.disconnect();
    workerConnection.disconnect();
  }
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

main().catch(error => {
  process.stderr.write(`[bullmq] ${error?.stack ?? error}\n`);
  process.exit(1);
});
