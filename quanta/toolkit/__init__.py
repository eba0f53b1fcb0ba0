"""Model-conversion tools built on the loaders, the quantizers and the writers, and the format comparison.

    quanta.quantize(model, out, method, ...) -> QuantizeSummary      (toolkit/quantize/)
    quanta.convert(src, to, out, ...) -> ConvertReport               (toolkit/convert/)
    quanta.bench(models, formats=..., peers=...) -> BenchResult      (toolkit/bench/)
"""
