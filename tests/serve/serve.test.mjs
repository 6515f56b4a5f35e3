// keel serve against the official openai client, on the demo model.
// Run by ctest (KEEL = the keel binary; working directory = the repository root).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createInterface } from 'node:readline';
import OpenAI from 'openai';

const KEEL = process.env.KEEL;
const MODEL = 'keel-tiny-v4';

async function startServer(args = []) {
  const proc = spawn(KEEL, ['serve', '--port', '0', '-q', ...args], {
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { ...process.env, OMP_WAIT_POLICY: 'passive' },
  });
  const lines = createInterface({ input: proc.stdout });
  const url = await new Promise((resolve, reject) => {
    proc.on('exit', (code) => reject(new Error(`keel serve exited with ${code}`)));
    lines.on('line', (line) => {
      const m = line.match(/^listening on (http:\/\/\S+)$/);
      if (m) resolve(m[1]);
    });
  });
  return { proc, url };
}

let server, client;
before(async () => {
  server = await startServer(['--max-running', '16', '--max-queued', '24']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
});
after(() => server?.proc.kill('SIGTERM'));

const hello = [{ role: 'user', content: 'Tell me about the morning walk.' }];

async function chat(params) {
  return client.chat.completions.create({ model: MODEL, messages: hello, max_tokens: 24, ...params });
}

async function streamText(params) {
  const stream = await client.chat.completions.create({ model: MODEL, messages: hello, max_tokens: 24, stream: true, ...params });
  let text = '', finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta?.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage };
}

async function metric(name) {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const line = text.split('\n').find((l) => l.startsWith(name + ' '));
  assert.ok(line, `metric ${name} missing`);
  return Number(line.slice(name.length + 1));
}

test('models lists the demo model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
});

test('chat completion', async () => {
  const r = await chat({ seed: 3 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(r.choices[0].message.content.length > 0);
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.prompt_tokens > 5);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test('streamed text equals the non-streamed text for the same seed', async () => {
  const whole = await chat({ seed: 11, temperature: 0.9, top_p: 0.95 });
  const streamed = await streamText({ seed: 11, temperature: 0.9, top_p: 0.95, stream_options: { include_usage: true } });
  assert.equal(streamed.text, whole.choices[0].message.content);
  assert.equal(streamed.finish, whole.choices[0].finish_reason);
  assert.deepEqual(streamed.usage, whole.usage);
});

test('seeds are reproducible', async () => {
  const a = await chat({ seed: 7, temperature: 1.0, max_tokens: 32 });
  const b = await chat({ seed: 7, temperature: 1.0, max_tokens: 32 });
  const c = await chat({ seed: 8, temperature: 1.0, max_tokens: 32 });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.notEqual(a.choices[0].message.content, c.choices[0].message.content);
});

test('stop sequences end the text before them', async () => {
  // The first seed whose reply is long enough to cut in the middle (the demo model may
  // end a sentence early; which seed depends on the sampler's stream, not on `stop`).
  let params, full = '';
  for (let seed = 21; seed < 29 && full.length <= 20; ++seed) {
    params = { seed, temperature: 0.8, max_tokens: 40, ignore_eos: true };
    full = (await chat(params)).choices[0].message.content;
  }
  assert.ok(full.length > 20, full);
  const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 3);
  const r = await chat({ ...params, stop: ['zzzzqqq', stop] });
  assert.equal(r.choices[0].message.content, full.slice(0, full.indexOf(stop)));
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await streamText({ ...params, stop: [stop] });
  assert.equal(s.text, full.slice(0, full.indexOf(stop)));
});

const weatherTool = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
};

test('tool call round trip is accepted and encoded', async () => {
  const messages = [
    { role: 'user', content: 'What is the weather in Paris?' },
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_0', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
    { role: 'tool', tool_call_id: 'call_0', content: '{"temperature": 21, "sky": "clear"}' },
  ];
  const withTools = await client.chat.completions.create({ model: MODEL, messages, tools: [weatherTool], tool_choice: 'auto', max_tokens: 8, seed: 1 });
  assert.equal(withTools.choices.length, 1);
  assert.equal(typeof withTools.choices[0].message.content, 'string');
  const first = await client.chat.completions.create({ model: MODEL, messages: messages.slice(0, 1), tools: [weatherTool], max_tokens: 8, seed: 1 });
  const noTools = await client.chat.completions.create({ model: MODEL, messages: messages.slice(0, 1), max_tokens: 8, seed: 1 });
  // The tools block, the call and its result are all in the prompt.
  assert.ok(first.usage.prompt_tokens > noTools.usage.prompt_tokens + 20);
  assert.ok(withTools.usage.prompt_tokens > first.usage.prompt_tokens + 10);
  // A malformed call is refused, naming the field.
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: [messages[0], { role: 'assistant', tool_calls: [{ id: 'x', type: 'function', function: { arguments: '{}' } }] }], max_tokens: 4 }),
    (e) => e.status === 400 && /messages\[1\]/.test(e.message),
  );
});

test('tool_choice required and named force a tool call', async () => {
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  // A named function: the reply opens with its call, whatever the (tiny) model writes next.
  const named = await client.chat.completions.create({
    model: MODEL, messages: ask, tools: [weatherTool], max_tokens: 12, seed: 1,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  const calls = named.choices[0].message.tool_calls;
  assert.ok(Array.isArray(calls) && calls.length >= 1);
  assert.equal(calls[0].function.name, 'get_weather');
  assert.equal(calls[0].type, 'function');
  // Streamed, the first tool-call delta carries the id and the name.
  const stream = await client.chat.completions.create({
    model: MODEL, messages: ask, tools: [weatherTool], max_tokens: 12, seed: 1, stream: true,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  let firstCall = null;
  for await (const chunk of stream) {
    const tc = chunk.choices[0]?.delta?.tool_calls;
    if (tc && !firstCall) firstCall = tc[0];
  }
  assert.equal(firstCall.function.name, 'get_weather');
  assert.ok(firstCall.id);
  // required: the prompt ends inside an opened tool-call block, a longer prompt than auto.
  const required = await client.chat.completions.create({ model: MODEL, messages: ask, tools: [weatherTool], tool_choice: 'required', max_tokens: 4, seed: 1 });
  const auto = await client.chat.completions.create({ model: MODEL, messages: ask, tools: [weatherTool], tool_choice: 'auto', max_tokens: 4, seed: 1 });
  assert.ok(required.usage.prompt_tokens > auto.usage.prompt_tokens);
  // Errors: an unknown function, no tools, thinking on.
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: ask, tools: [weatherTool], max_tokens: 4, tool_choice: { type: 'function', function: { name: 'nope' } } }),
    (e) => e.status === 400 && e.param === 'tool_choice',
  );
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: ask, max_tokens: 4, tool_choice: 'required' }),
    (e) => e.status === 400 && e.param === 'tool_choice',
  );
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: ask, tools: [weatherTool], max_tokens: 4, tool_choice: 'required', thinking: { type: 'enabled' } }),
    (e) => e.status === 400 && e.param === 'tool_choice',
  );
});

test('reasoning: thinking on gives reasoning_content', async () => {
  const on = await chat({ seed: 5, thinking: true, max_tokens: 16 });
  assert.equal(typeof on.choices[0].message.reasoning_content, 'string');
  const off = await chat({ seed: 5, max_tokens: 16 });
  assert.equal(off.choices[0].message.reasoning_content, undefined);
  const max = await chat({ seed: 5, thinking: true, reasoning_effort: 'max', max_tokens: 4 });
  assert.ok(max.usage.prompt_tokens > on.usage.prompt_tokens, 'reasoning_effort max adds its preamble');
});

test('completions endpoint', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'It was a fine morning, and Elizabeth', max_tokens: 12, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.ok(r.choices[0].text.length > 0);
  assert.equal(r.usage.completion_tokens, 12);
});

test('JSON responses keep the connection alive; event streams close it', async () => {
  const post = (body) => fetch(`${server.url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, prompt: 'The quick brown fox', max_tokens: 4, temperature: 0, ...body }) });
  const texts = [];
  for (let i = 0; i < 3; ++i) {
    const res = await post({});
    assert.equal(res.headers.get('connection'), 'keep-alive');
    texts.push((await res.json()).choices[0].text);
  }
  assert.deepEqual(texts, [texts[0], texts[0], texts[0]]);
  const streamed = await post({ stream: true });
  assert.equal(streamed.headers.get('connection'), 'close');
  assert.ok((await streamed.text()).includes('[DONE]'));
});

test('bad requests get OpenAI errors with the right status', async () => {
  const post = (body, headers = {}) => fetch(`${server.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body });
  let res = await post('{"model": "keel-tiny-v4", "messages": [');
  assert.equal(res.status, 400);
  assert.equal((await res.json()).error.type, 'invalid_request_error');
  res = await post(Buffer.concat([Buffer.from('{"model": "keel-tiny-v4", "messages": [{"role": "user", "content": "a'), Buffer.from([0xff, 0xfe]), Buffer.from('"}]}')]));
  assert.equal(res.status, 400);
  assert.ok((await res.json()).error.message.length > 0);
  res = await fetch(`${server.url}/v1/nothing`);
  assert.equal(res.status, 404);
  await assert.rejects(client.chat.completions.create({ model: 'no-such-model', messages: hello }), (e) => e.status === 404 && e.code === 'model_not_found');
  await assert.rejects(chat({ max_tokens: -5 }), (e) => e.status === 400 && e.param === 'max_tokens');
  await assert.rejects(chat({ temperature: 7 }), (e) => e.status === 400 && e.param === 'temperature');
  await assert.rejects(chat({ priority: 'high' }), (e) => e.status === 400 && e.param === 'priority');
  const prioritized = await chat({ priority: -2, temperature: 0 });
  assert.equal(prioritized.choices.length, 1);
  assert.ok(prioritized.choices[0].finish_reason);
  const long = 'the morning was fine and '.repeat(1200);
  await assert.rejects(chat({ messages: [{ role: 'user', content: long }] }), (e) => e.status === 400 && e.code === 'context_length_exceeded');
  await assert.rejects(chat({ messages: [{ role: 'wizard', content: 'x' }] }), (e) => e.status === 400);
});

test('api key and body limit', async () => {
  const guarded = await startServer(['--api-key', 'sesame', '--max-body-bytes', '2000']);
  try {
    const bad = new OpenAI({ baseURL: `${guarded.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e.status === 401);
    const good = new OpenAI({ baseURL: `${guarded.url}/v1`, apiKey: 'sesame', maxRetries: 0 });
    assert.equal((await good.models.list()).data[0].id, MODEL);
    await assert.rejects(good.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'x'.repeat(5000) }] }), (e) => e.status === 413);
  } finally {
    guarded.proc.kill('SIGTERM');
  }
});

// 64 streaming clients for a bounded time: every request completes or gets 503, each
// stream equals the non-streamed result of its seed, and clients that disconnect
// mid-stream have their requests cancelled and state freed.
test('keel bench serve measures a run against the server', async () => {
  const { execFileSync } = await import('node:child_process');
  const out = execFileSync(KEEL, ['bench', 'serve', '--url', server.url, '--num-prompts', '8', '--concurrency', '4',
    '--input-len', '24', '--output-len', '6', '--json'], { encoding: 'utf8' });
  const r = JSON.parse(out);
  assert.equal(r.model, MODEL);
  assert.equal(r.completed, 8, r.first_error);
  assert.equal(r.output_tokens, 8 * 6);  // ignore_eos: every request runs to --output-len
  assert.equal(r.input_tokens, 8 * 24);
  assert.ok(r.ttft_ms.p50 > 0 && r.e2e_ms.p99 >= r.ttft_ms.p99 && r.tpot_ms.mean > 0);
  assert.ok(r.request_throughput > 0 && r.output_throughput > 0);
});

test('keel bench serve sends the prompts of a file', async () => {
  const { execFileSync } = await import('node:child_process');
  const { mkdtempSync, writeFileSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const dir = mkdtempSync(join(tmpdir(), 'keel-prompts-'));
  const file = join(dir, 'prompts.jsonl');
  const texts = ['It was a fine morning.', 'The garden behind the house was quiet.'];
  writeFileSync(file, `{"prompt": ${JSON.stringify(texts[0])}}\n\n${texts[1]}\n`);
  const usage = [];
  for (const text of texts) usage.push((await client.completions.create({ model: MODEL, prompt: text, max_tokens: 1 })).usage.prompt_tokens);
  const out = execFileSync(KEEL, ['bench', 'serve', '--url', server.url, '--prompts', file, '--num-prompts', '5',
    '--output-len', '4', '--json'], { encoding: 'utf8' });
  const r = JSON.parse(out);
  assert.equal(r.completed, 5, r.first_error);
  assert.equal(r.input_tokens, 3 * usage[0] + 2 * usage[1]);  // the file's two prompts in turn
  assert.equal(r.output_tokens, 5 * 4);
  writeFileSync(file, '{"text": "no prompt field"}\n');
  assert.throws(() => execFileSync(KEEL, ['bench', 'serve', '--url', server.url, '--prompts', file], { stdio: 'pipe' }),
    (e) => e.status !== 0 && /line 1/.test(e.stderr.toString()));
});

test('load: 64 concurrent streaming clients', async () => {
  const seconds = 12, seeds = 16;
  const deadline = Date.now() + seconds * 1000;
  const results = [];  // { seed, text }
  let rejected = 0, aborted = 0;
  const prompt = (seed) => [{ role: 'user', content: `Story number ${seed} about the morning.` }];
  const worker = async (w) => {
    let i = 0;
    while (Date.now() < deadline) {
      const seed = (w + i++) % seeds;
      const abort = w % 8 === 0 && i % 2 === 0;
      try {
        if (abort) {
          const controller = new AbortController();
          const stream = await client.chat.completions.create(
            { model: MODEL, messages: prompt(seed), max_tokens: 2000, ignore_eos: true, stream: true, seed, temperature: 0.8 },
            { signal: controller.signal });
          let n = 0;
          try {
            for await (const chunk of stream) {
              if (++n === 3) controller.abort();
            }
          } catch (e) {
            if (!(e instanceof OpenAI.APIUserAbortError || e.name === 'AbortError')) throw e;
          }
          aborted++;
          continue;
        }
        const stream = await client.chat.completions.create({ model: MODEL, messages: prompt(seed), max_tokens: 12, stream: true, seed, temperature: 0.8 });
        let text = '';
        for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
        results.push({ seed, text });
      } catch (e) {
        if (e.status === 503) {
          rejected++;
          await new Promise((r) => setTimeout(r, 250));
        } else {
          throw e;
        }
      }
    }
  };
  await Promise.all(Array.from({ length: 64 }, (_, w) => worker(w)));
  assert.ok(results.length >= 64, `only ${results.length} requests completed`);
  assert.ok(aborted > 0);
  const reference = [];
  for (let seed = 0; seed < seeds; ++seed) {
    const r = await client.chat.completions.create({ model: MODEL, messages: prompt(seed), max_tokens: 12, seed, temperature: 0.8 });
    reference.push(r.choices[0].message.content);
  }
  for (const { seed, text } of results) assert.equal(text, reference[seed], `seed ${seed}`);
  // Disconnected clients: cancelled, and nothing left running or holding state.
  let running = -1, bytes = -1;
  for (let i = 0; i < 100 && (running !== 0 || bytes !== 0); ++i) {
    running = await metric('keel_running_requests');
    bytes = await metric('keel_state_bytes');
    if (running !== 0 || bytes !== 0) await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(running, 0);
  assert.equal(bytes, 0);
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const cancelled = Number((text.match(/^keel_requests_finished_total\{reason="cancelled"\} (\d+)/m) ?? [0, 0])[1]);
  assert.ok(cancelled >= aborted, `cancelled ${cancelled} < aborted ${aborted}`);
  console.log(`load: ${results.length} streams completed, ${rejected} rejected (503), ${aborted} aborted, `
    + `${await metric('keel_generation_tokens_total')} tokens generated in total`);
});
