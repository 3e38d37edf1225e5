//! Where the embedded interpreter comes from: the binary (and the test executables, which link libpython
//! through pyo3) find libpython through an rpath to the build interpreter's library directory, so
//! `ft-server` runs without LD_LIBRARY_PATH; the build interpreter itself is recorded for `ft-server`'s last
//! way of finding the Python environment (after --python-env and VIRTUAL_ENV).

fn main() {
    let config = pyo3_build_config::get();
    if let Some(lib_dir) = &config.lib_dir {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    let python = config.executable.clone().unwrap_or_default();
    println!("cargo:rustc-env=FT_BUILD_PYTHON={python}");
    println!("cargo:rustc-env=FT_BUILD_PYTHON_VERSION={}.{}", config.version.major, config.version.minor);
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
}
