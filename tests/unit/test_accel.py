from mlxd import accel

AVX512_FLAGS = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}


def test_coretype_follows_cpu_flags():
    assert accel.openblas_coretype(AVX512_FLAGS) == "SkylakeX"
    assert accel.openblas_coretype({"avx", "avx2", "fma"}) == "Haswell"
    assert accel.openblas_coretype({"sse3"}) is None
    assert accel.openblas_coretype(set()) is None


def test_optimized_env_preloads_first_and_keeps_user_choices(monkeypatch):
    monkeypatch.setattr(accel, "find_optimized_blas", lambda: "/x/openblas-pthread/libblas.so.3")
    monkeypatch.setattr(accel, "cpu_flags", lambda: AVX512_FLAGS)
    env = accel.optimized_env({"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == "/x/openblas-pthread/libblas.so.3:/other.so"
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert env["PATH"] == "/bin"
    mine = accel.optimized_env({"OPENBLAS_CORETYPE": "Haswell"})
    assert mine["OPENBLAS_CORETYPE"] == "Haswell"
    # Already optimized: nothing changes, so mlxd does not re-execute itself.
    assert accel.optimized_env(env) == env


def test_optimized_env_without_a_blas_changes_nothing(monkeypatch):
    monkeypatch.setattr(accel, "find_optimized_blas", lambda: None)
    assert accel.optimized_env({"A": "1"}) == {"A": "1"}
