"""Model-conversion tools built on the loaders, the quantizers and the writers.

    quanta.quantize(model, out, method, ...) -> QuantizeSummary      (toolkit/quantize.py)
    quanta.convert(src, to, out, ...) -> ConvertReport               (toolkit/convert.py)
"""
