use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STEP_CONTRACT_VERSION", ft_core::step::STEP_CONTRACT_VERSION)?;
    Ok(())
}
