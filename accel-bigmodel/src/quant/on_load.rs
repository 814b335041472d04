//! [`QuantizeOnLoad`]: a full-precision checkpoint served as the
//! pre-quantized checkpoint transformers would save for it.
//!
//! A linear layer asks its weight source for the parts of a quantized weight
//! (`{m}.weight.quant_state.bitsandbytes__nf4`, `{m}.weight` as u8 bytes,
//! `{m}.weight.absmax`, ...; `{m}.SCB` and the int8 `{m}.weight` for 8 bits).
//! A source with this setting answers those requests for every 2-D float
//! weight the configuration quantizes, computing them from the checkpoint's
//! tensor when the first part is asked for; other requests (the same
//! `{m}.weight` in a float dtype, embeddings, norms) get the checkpoint's
//! tensors unchanged. Only the weights of one or two modules are ever held
//! in full precision, so loading a model quantized never holds it whole.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use super::config::{BnbQuantizationConfig, QuantMethod};
use super::int8::{quantize_int8_weight, Int8Rows};
use super::state::{names, quant_state_name, Packed4bit};
use crate::error::{Error, Result};

/// Whether a module stores its weight `[in, out]` (GPT-2's `Conv1D`), which
/// transformers transposes to `[out, in]` before quantizing.
pub type TransposedFn = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// A weight quantized as the configuration says.
#[derive(Debug, Clone, PartialEq)]
pub enum Quantized {
    /// 4-bit blocks.
    FourBit(Packed4bit),
    /// LLM.int8 rows of a `[out, in]` weight.
    EightBit {
        /// `[out, in]`.
        shape: Vec<usize>,
        /// Codes and row maxima.
        rows: Int8Rows,
    },
}

/// Quantizes a checkpoint's linear weights as they are read (see the module).
pub struct QuantizeOnLoad {
    config: BnbQuantizationConfig,
    method: QuantMethod,
    transposed: Option<TransposedFn>,
    /// The last few modules quantized, by weight name: a layer asks for
    /// several parts of one weight in a row.
    recent: Mutex<VecDeque<(String, Arc<Quantized>)>>,
}

impl std::fmt::Debug for QuantizeOnLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizeOnLoad")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Modules kept quantized at once.
const RECENT: usize = 2;

/// A part of a quantized weight a layer asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    State,
    Packed,
    Absmax,
    QuantMap,
    NestedAbsmax,
    NestedQuantMap,
    Scb,
    WeightFormat,
}

impl QuantizeOnLoad {
    /// Quantization as `config` says.
    ///
    /// # Errors
    /// A config that sets both or neither of 4 and 8 bits.
    pub fn new(config: BnbQuantizationConfig) -> Result<Self> {
        let method = config.method()?;
        Ok(Self {
            config,
            method,
            transposed: None,
            recent: Mutex::default(),
        })
    }

    /// The same, with the modules whose checkpoint weight is `[in, out]`.
    pub fn with_transposed(mut self, transposed: TransposedFn) -> Self {
        self.transposed = Some(transposed);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &BnbQuantizationConfig {
        &self.config
    }

    /// The module and part `name` asks for, when it names a part of a
    /// quantized weight (the packed `weight` only when asked for as u8).
    fn part<'n>(&self, name: &'n str, dtype: Option<DType>) -> Option<(&'n str, Part)> {
        let four = self.method == QuantMethod::FourBit;
        let state = quant_state_name(self.config.bnb_4bit_quant_type);
        let suffixes: [(&str, Part, bool); 8] = [
            (&state, Part::State, four),
            (names::ABSMAX, Part::Absmax, four),
            (names::QUANT_MAP, Part::QuantMap, four),
            (
                names::NESTED_ABSMAX,
                Part::NestedAbsmax,
                four && self.config.bnb_4bit_use_double_quant,
            ),
            (
                names::NESTED_QUANT_MAP,
                Part::NestedQuantMap,
                four && self.config.bnb_4bit_use_double_quant,
            ),
            (names::SCB, Part::Scb, !four),
            (names::WEIGHT_FORMAT, Part::WeightFormat, !four),
            ("", Part::Packed, dtype == Some(DType::U8)),
        ];
        for (suffix, part, applies) in suffixes {
            if !applies {
                continue;
            }
            let module = match part {
                Part::Packed => name.strip_suffix(".weight"),
                Part::Scb | Part::WeightFormat => {
                    name.strip_suffix(suffix).and_then(|m| m.strip_suffix('.'))
                }
                _ => name
                    .strip_suffix(suffix)
                    .and_then(|m| m.strip_suffix(".weight.")),
            };
            if let Some(module) = module {
                return Some((module, part));
            }
        }
        None
    }

    /// Whether `name` (asked for in `dtype`) is a part this setting serves,
    /// given `weight`: the shape and dtype of the module's checkpoint weight.
    ///
    /// # Errors
    /// A bad skip pattern.
    pub fn serves(
        &self,
        name: &str,
        dtype: Option<DType>,
        weight: impl FnOnce(&str) -> Option<(Vec<usize>, DType)>,
    ) -> Result<bool> {
        let Some((module, _)) = self.part(name, dtype) else {
            return Ok(false);
        };
        let quantizable = weight(&format!("{module}.weight")).is_some_and(|(shape, dt)| {
            shape.len() == 2 && matches!(dt, DType::F32 | DType::BF16 | DType::F16)
        });
        Ok(quantizable && self.config.quantizes(module)?)
    }

    /// Part `name` as a tensor on `device`, quantizing the module's weight
    /// (read by `read`: its f32 values, shape and stored dtype) when it is
    /// not among the recent ones. `None` when `name` is not a part.
    ///
    /// # Errors
    /// Those of `read`.
    pub fn tensor(
        &self,
        name: &str,
        dtype: Option<DType>,
        device: &Device,
        read: impl FnOnce(&str) -> Result<(Vec<f32>, Vec<usize>, DType)>,
    ) -> Result<Option<Tensor>> {
        let Some((module, part)) = self.part(name, dtype) else {
            return Ok(None);
        };
        let q = self.quantized(module, read)?;
        Ok(Some(part_tensor(&q, part, device)?))
    }

    /// The quantized weight of `module`, from the recent ones or computed.
    fn quantized(
        &self,
        module: &str,
        read: impl FnOnce(&str) -> Result<(Vec<f32>, Vec<usize>, DType)>,
    ) -> Result<Arc<Quantized>> {
        let weight = format!("{module}.weight");
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, q)) = recent.iter().find(|(n, _)| *n == weight) {
            return Ok(q.clone());
        }
        let (mut values, mut shape, stored) = read(&weight)?;
        if self.transposed.as_ref().is_some_and(|t| t(module)) {
            values = transpose(&values, shape[0], shape[1]);
            shape.reverse();
        }
        let q = Arc::new(self.quantize(&values, &shape, stored));
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back((weight, q.clone()));
        Ok(q)
    }

    /// `values` (a weight of `shape`, stored as `stored`) quantized.
    pub fn quantize(&self, values: &[f32], shape: &[usize], stored: DType) -> Quantized {
        match self.method {
            QuantMethod::FourBit => Quantized::FourBit(Packed4bit::quantize(
                values,
                shape,
                stored,
                self.config.bnb_4bit_quant_type,
                self.config.bnb_4bit_use_double_quant,
            )),
            QuantMethod::EightBit => Quantized::EightBit {
                shape: shape.to_vec(),
                rows: quantize_int8_weight(values, shape[1]),
            },
        }
    }
}

/// `m [rows, cols]` transposed.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// One part of `q` as a tensor (as transformers' checkpoint stores it).
fn part_tensor(q: &Quantized, part: Part, device: &Device) -> Result<Tensor> {
    let t = match (q, part) {
        (Quantized::FourBit(p), Part::State) => {
            let json = p.state.to_json().into_bytes();
            let n = json.len();
            Tensor::from_vec(json, n, device)?
        }
        (Quantized::FourBit(p), Part::Packed) => {
            let n = p.packed.len();
            Tensor::from_vec(p.packed.clone(), (n, 1), device)?
        }
        (Quantized::FourBit(p), Part::Absmax) => match &p.nested {
            Some(n) => Tensor::new(n.codes.as_slice(), device)?,
            None => Tensor::new(p.absmax.as_slice(), device)?,
        },
        (Quantized::FourBit(p), Part::QuantMap) => {
            Tensor::new(p.state.quant_type.codes().as_slice(), device)?
        }
        (
            Quantized::FourBit(Packed4bit {
                nested: Some(n), ..
            }),
            Part::NestedAbsmax,
        ) => Tensor::new(n.absmax.as_slice(), device)?,
        (
            Quantized::FourBit(Packed4bit {
                nested: Some(_), ..
            }),
            Part::NestedQuantMap,
        ) => Tensor::new(super::dynamic_map().as_slice(), device)?,
        (Quantized::EightBit { shape, rows }, Part::Packed) => {
            let bytes: Vec<u8> = rows.codes.iter().map(|&c| c as u8).collect();
            Tensor::from_vec(bytes, (shape[0], shape[1]), device)?
        }
        (Quantized::EightBit { rows, .. }, Part::Scb) => {
            Tensor::new(rows.row_max.as_slice(), device)?
        }
        (Quantized::EightBit { .. }, Part::WeightFormat) => Tensor::new(0u8, device)?,
        (_, part) => {
            return Err(Error::BadQuantState {
                tensor: format!("{part:?}"),
                reason: "not a part of this quantized weight".into(),
            })
        }
    };
    Ok(t)
}
