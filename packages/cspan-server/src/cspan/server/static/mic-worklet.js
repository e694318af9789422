// AudioWorklet "mic-frames": cuts the microphone into frames of exactly `frameSize` samples at `outputRate`
// (1920 samples = 80 ms at 24 kHz) and posts each one (a transferred Float32Array) to the page.
// When the AudioContext does not run at the output rate, samples are resampled by linear interpolation.

class MicFrames extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = (options && options.processorOptions) || {};
    this.frameSize = o.frameSize || 1920;
    this.step = (o.inputRate || sampleRate) / (o.outputRate || 24000); // input samples per output sample
    this.frame = new Float32Array(this.frameSize);
    this.n = 0;
    this.pos = 0; // fractional read position relative to the current input block
    this.last = 0; // last sample of the previous block (for interpolation across blocks)
  }

  push(x) {
    this.frame[this.n++] = x;
    if (this.n === this.frameSize) {
      this.port.postMessage(this.frame, [this.frame.buffer]);
      this.frame = new Float32Array(this.frameSize);
      this.n = 0;
    }
  }

  process(inputs) {
    const input = inputs[0];
    const ch = input && input[0];
    if (!ch) return true;
    if (this.step === 1) {
      for (let i = 0; i < ch.length; i++) this.push(ch[i]);
      return true;
    }
    // position p in [-1, ch.length): p < 0 interpolates between the previous block's last sample and ch[0]
    let p = this.pos;
    while (p < ch.length - 1) {
      const i = Math.floor(p);
      const frac = p - i;
      const a = i < 0 ? this.last : ch[i];
      const b = ch[i + 1];
      this.push(a + (b - a) * frac);
      p += this.step;
    }
    this.pos = p - ch.length;
    this.last = ch[ch.length - 1];
    return true;
  }
}

registerProcessor("mic-frames", MicFrames);
