// AudioWorklet "agent-player": plays the agent's 80 ms frames through a small adaptive jitter buffer.
//
// - Playback (re)starts once `targetMs` of audio is queued (Moshi's "partial buffer" rule), with a short fade-in.
// - Underrun (queue empty while playing): fade out, stop, wait for `targetMs` again, and grow the target by 40 ms
//   (up to `maxMs`), reported to the page as {type: "underrun"}.
// - While playback has been smooth for 10 s the target shrinks by 10 ms (down to `minMs`).
// - Hard cut: when more than target + 600 ms is queued (the network delivered a burst), the oldest frames are
//   dropped down to the target, reported as {type: "cut"}.
// Frames arrive at `inputRate` (24 kHz); when the AudioContext runs at another rate they are resampled by linear
// interpolation. Once a second the page gets {type: "stats", queuedMs, targetMs, underruns, droppedMs}.

class AgentPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.inputRate = o.inputRate || 24000;
    this.step = this.inputRate / sampleRate; // input samples per output sample
    this.targetMs = o.targetMs || 120;
    this.minMs = o.minMs || 60;
    this.maxMs = o.maxMs || 400;
    this.chunks = [];
    this.queued = 0; // input samples in `chunks`
    this.pos = 0; // fractional read position in chunks[0]
    this.playing = false;
    this.fade = 0; // 0..1 gain ramp applied after (re)start
    this.underruns = 0;
    this.droppedMs = 0;
    this.smoothFor = 0; // output samples since the last underrun
    this.statsEvery = Math.round(sampleRate);
    this.sinceStats = 0;
    this.port.onmessage = (e) => {
      if (e.data === "reset") {
        this.chunks = [];
        this.queued = 0;
        this.pos = 0;
        this.playing = false;
        return;
      }
      const frame = e.data;
      this.chunks.push(frame);
      this.queued += frame.length;
      this.cut();
    };
  }

  queuedMs() {
    return ((this.queued - this.pos) * 1000) / this.inputRate;
  }

  cut() {
    if (this.queuedMs() <= this.targetMs + 600) return;
    let dropped = 0;
    while (this.chunks.length > 1 && this.queuedMs() > this.targetMs) {
      const c = this.chunks.shift();
      this.queued -= c.length;
      dropped += c.length - this.pos;
      this.pos = 0;
    }
    const ms = (dropped * 1000) / this.inputRate;
    this.droppedMs += ms;
    this.port.postMessage({ type: "cut", cutMs: ms, targetMs: this.targetMs });
  }

  sample() {
    // linear interpolation between chunks[0][i] and the next sample (possibly in chunks[1])
    const c = this.chunks[0];
    const i = Math.floor(this.pos);
    const frac = this.pos - i;
    const a = c[i];
    let b = a;
    if (frac > 0) {
      if (i + 1 < c.length) b = c[i + 1];
      else if (this.chunks.length > 1) b = this.chunks[1][0];
    }
    return a + (b - a) * frac;
  }

  advance() {
    this.pos += this.step;
    while (this.chunks.length && this.pos >= this.chunks[0].length) {
      this.pos -= this.chunks[0].length;
      this.queued -= this.chunks[0].length;
      this.chunks.shift();
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing) {
      if (this.chunks.length && this.queuedMs() >= this.targetMs) {
        this.playing = true;
        this.fade = 0;
      } else {
        out.fill(0);
        return this.report(out.length);
      }
    }
    for (let i = 0; i < out.length; i++) {
      if (!this.chunks.length) {
        // underrun: ramp the last samples down, then silence until the buffer is refilled
        for (let j = Math.max(0, i - 32); j < i; j++) out[j] *= (i - j) / 32;
        out.fill(0, i);
        this.playing = false;
        this.underruns++;
        this.smoothFor = 0;
        this.targetMs = Math.min(this.maxMs, this.targetMs + 40);
        this.port.postMessage({ type: "underrun", targetMs: this.targetMs });
        break;
      }
      let x = this.sample();
      if (this.fade < 1) {
        this.fade = Math.min(1, this.fade + 1 / 64);
        x *= this.fade;
      }
      out[i] = x;
      this.advance();
    }
    if (this.playing) {
      this.smoothFor += out.length;
      if (this.smoothFor > 10 * sampleRate && this.targetMs > this.minMs) {
        this.targetMs = Math.max(this.minMs, this.targetMs - 10);
        this.smoothFor = 0;
      }
    }
    return this.report(out.length);
  }

  report(n) {
    this.sinceStats += n;
    if (this.sinceStats >= this.statsEvery) {
      this.sinceStats = 0;
      this.port.postMessage({
        type: "stats",
        queuedMs: this.queuedMs(),
        targetMs: this.targetMs,
        underruns: this.underruns,
        droppedMs: this.droppedMs,
      });
    }
    return true;
  }
}

registerProcessor("agent-player", AgentPlayer);
